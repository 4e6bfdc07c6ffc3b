"""llama.cpp's side of benchmarks/peers.py, run in a child process: the same workload
through llama-cpp-python's low-level API, batch by batch, greedy argmax in numpy; and
how to build llama-cpp-python for this CPU."""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np

GGML_Q8_0 = 8  # ggml_type: llama.cpp's 8-bit KV cache type
WARM_TOKENS = 8  # the untimed pass: llama.cpp has nothing to compile

# FINDINGS.md's build, each SIMD extension switched on only where this CPU has it (a
# build with AVX-VNNI on a CPU without it dies of SIGILL in the Q4_1 dot product).
CPU_FLAGS = {"AVX": "avx", "AVX2": "avx2", "FMA": "fma", "F16C": "f16c", "BMI2": "bmi2",
             "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi", "AVX512_VNNI": "avx512_vnni",
             "AVX512_BF16": "avx512_bf16", "AVX_VNNI": "avx_vnni"}


def decode_bytes(path: Path) -> int:
    """The weight bytes llama.cpp reads for a decode token of a GGUF file, from its own
    tensor types: every matrix whole, but the embedding (one row), and of each expert
    stack the share a token is routed to; a tied model's embedding is its head."""
    import gguf

    reader = gguf.GGUFReader(path)

    def field(key: str, default: int) -> int:
        f = reader.fields.get(key)
        return default if f is None else int(f.parts[f.data[0]][0])

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    share = field(f"{arch}.expert_used_count", 1) / field(f"{arch}.expert_count", 1)
    names = {t.name for t in reader.tensors}
    total = 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            total += int(t.n_bytes) / int(t.shape[-1])  # untied: a row a token
        else:
            total += int(t.n_bytes) * (share if "_exps." in t.name else 1)
    return int(total)


def install_hint() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        have = set(next(l for l in text.splitlines() if l.startswith("flags")).split(":")[1].split())
    except (OSError, StopIteration):
        have = set(CPU_FLAGS.values())
    args = ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{k}={'ON' if v in have else 'OFF'}" for k, v in CPU_FLAGS.items()]
    args += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return (f'CMAKE_ARGS="{" ".join(args)}" .venv/bin/pip install --no-cache-dir '
            "--force-reinstall --no-deps llama-cpp-python==0.3.36 && .venv/bin/pip install diskcache")


class LlamaCpp:
    """A llama.cpp context for `n_seq` sequences, each with its own n_ctx / n_seq cells
    (llama-server's layout; one unified cache measured 4x slower at 16 streams here, as
    every sequence attends over all cells), driven batch by batch through the
    low-level API, greedy argmax in numpy."""

    def __init__(self, path: str, *, threads: int, n_ctx: int, n_seq: int, n_batch: int = 512,
                 eight_bit_kv: bool = False):
        import llama_cpp as L

        self.L = L
        self._quiet = L.llama_log_callback(lambda level, text, user: None)  # keep a reference
        L.llama_log_set(self._quiet, ctypes.c_void_p(0))
        L.llama_backend_init()
        self.model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
        cp.n_threads = cp.n_threads_batch = threads
        cp.kv_unified = False
        cp.no_perf = True
        if eight_bit_kv:
            cp.type_k = cp.type_v = GGML_Q8_0
            cp.flash_attn_type = 1  # enabled: a quantized V cache needs it
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.batch = L.llama_batch_init(n_batch, 0, 1)

    def clear(self) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows: (token, position, sequence, wants logits); greedy tokens of those that do."""
        b = self.batch
        b.n_tokens = len(rows)
        for i, (token, pos, seq, out) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = token, pos, 1, seq, out
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        logits = (self.L.llama_get_logits_ith(self.ctx, i) for i, row in enumerate(rows) if row[3])
        return [int(np.ctypeslib.as_array(p, shape=(self.n_vocab,)).argmax()) for p in logits]

    def prefill(self, ids: list[int], seq: int) -> int:
        for start in range(0, len(ids), self.n_batch):
            chunk = ids[start : start + self.n_batch]
            last = start + len(chunk) == len(ids)
            out = self._decode([(t, start + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)])
        return out[0]

    def step(self, tokens: list[int], positions: list[int]) -> list[int]:
        """One token for each of sequences 0 .. len(tokens) - 1."""
        return self._decode([(t, p, s, True) for s, (t, p) in enumerate(zip(tokens, positions))])


def llama_cpp_runs(job: dict) -> list[dict]:
    """job: peers.py's (the file, threads, cells, KV type, each run's Workload as a dict,
    the tokens each stream generates)."""
    streams = len(job["runs"][0]["streams"])
    peer = LlamaCpp(job["model"], threads=job["threads"], n_ctx=job["n_ctx"], n_seq=streams,
                    eight_bit_kv=job["kv"] == "8-bit")
    out = []
    for k, w in enumerate(job["runs"]):
        new = WARM_TOKENS if k == 0 else job["new_tokens"]
        peer.clear()
        tokens = [peer.prefill(w["single"], 0)]
        first = time.perf_counter()
        for i in range(new - 1):
            tokens += peer.step(tokens[-1:], [len(w["single"]) + i])
        single = {"decode_tok_s": (new - 1) / (time.perf_counter() - first), "generated": new, "tokens": tokens}

        peer.clear()
        started = time.perf_counter()
        last = [peer.prefill(ids, s) for s, ids in enumerate(w["streams"])]
        all_prefilled = time.perf_counter()
        for i in range(new - 1):
            last = peer.step(last, [len(ids) + i for ids in w["streams"]])
        end = time.perf_counter()
        many = {"aggregate_decode_tok_s": streams * (new - 1) / (end - all_prefilled), "wall_s": end - started,
                "tokens_after_all_prefilled": streams * (new - 1), "generated_per_stream": [new] * streams}

        peer.clear()
        started = time.perf_counter()
        peer.prefill(w["prefill"], 0)
        ttft = time.perf_counter() - started
        out.append({"single": single, "streams": many,
                    "prefill": {"tok_s": len(w["prefill"]) / ttft, "ttft_s": ttft}})
    return out
