"""The command's flags (cli/config.py builds the Config from them, with the environment
where a flag is not given)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..runtime.config import DEFAULT_BURST, EXPERT_MODES
from ..runtime.kv_format import KV_DTYPE_CHOICES
from ..runtime.serve_settings import TOOL_FAMILIES


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None,
                   help="a .gguf file or a Hugging Face model directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: a quantized GGUF's weights stay quantized (computed in float32); "
                        "float32 or bfloat16: every weight dequantized to that type")
    p.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="quantize the weights a checkpoint holds as floats (bf16/f32 safetensors, "
                        "F16/F32 GGUF) at load: weight-only, a scale per 32 values")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_CHOICES, default="auto",
                   help="the KV cache's element type (auto: float16 under quantized weights, as "
                        "llama.cpp's cache; otherwise the weights' dtype; int8 and fp8: 8 bits with a "
                        "float32 scale per position and KV head, half float16's bytes)")
    p.add_argument("--activations", choices=("int16", "int8"), default="int16",
                   help="what the quantized products round x to on the CPU: int16 per 32 values (the "
                        "default, within 1e-4 of float32), or int8 as llama.cpp does (a faster prefill of "
                        "4-bit weights, about 1e-2 of a product's largest output off)")
    p.add_argument("--max-context", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--compile-cache", type=Path, default=None,
                   help="JAX's persistent compilation cache (MOTET_COMPILE_CACHE; '' turns it off)")
    p.add_argument("--mesh", default=None, metavar="ep=N,tp=M",
                   help="shard the model over this process's devices: experts along ep, heads and FFN "
                   "widths along tp (MOTET_MESH; docs/scaling.md)")


def _add_warm_up_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                   help="be ready before compiling every shape (requests then wait while each new one compiles)")
    p.add_argument("--no-share-prefixes", dest="share_prefixes", action="store_false",
                   help="read every prompt's prefix in its own slot, never copying it from another slot")
    p.add_argument("--prefix-cache-gb", type=float, default=0.0, metavar="GB",
                   help="host RAM for prefixes pushed out of the KV slots, written back when a prompt "
                   "starts with one (default 0: none kept)")
    p.add_argument("--decode-burst", type=int, default=DEFAULT_BURST, metavar="N",
                   help=f"decode steps of one stream a device call takes while no other request waits and it "
                   f"samples plainly (default {DEFAULT_BURST}; 1: one a call); its tokens arrive N at a time")


def _add_group_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                   help="several processes as one engine: process 0's address for jax.distributed "
                   "(MOTET_COORDINATOR; docs/scaling.md)")
    p.add_argument("--num-processes", type=int, default=None, metavar="N",
                   help="processes in the group (MOTET_NUM_PROCESSES); --mesh then spans all their devices")
    p.add_argument("--process-id", type=int, default=None, metavar="I",
                   help="this process, 0 to N-1 (MOTET_PROCESS_ID): 0 serves, the others follow it")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)


def _add_expert_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experts", choices=EXPERT_MODES, default=None,
                   help="expert placement (EXPERTS; default auto: tiered only when over a budget)")
    p.add_argument("--device-gb", type=float, default=None, help="device budget for the weights, GB (DEVICE_GB)")
    p.add_argument("--ram-gb", type=float, default=None, help="host RAM for experts off the device, GB (RAM_GB)")
    p.add_argument("--heat-file", type=Path, default=None,
                   help="where expert heat persists (HEAT_FILE; default: next to the model when tiered)")
    p.add_argument("--expert-policy", choices=("heat", "lru"), default=None, help="EXPERT_POLICY (default heat)")
    p.add_argument("--no-prefetch", action="store_true", default=None,
                   help="do not guess the next layer's experts (EXPERT_PREFETCH=0)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="motet", description="motet: an MoE LLM inference engine")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logs on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    chat = sub.add_parser("chat", help="answer a prompt (or chat interactively), streamed")
    chat.add_argument("prompt", nargs="?", help="one-shot prompt; without it, an interactive loop")
    chat.add_argument("--system", default=None, help="a system message")
    _add_model_flags(chat)
    _add_sampling_flags(chat)
    info = sub.add_parser("info", help="describe the model, and what an engine would compile for it")
    info.add_argument("--kv-slots", type=int, default=16, help="the engine's KV slots (what it compiles)")
    _add_model_flags(info)
    muxp = sub.add_parser("mux", help="serve the mux protocol on stdin/stdout (SNAP, KV_SLOTS, CTX, "
                          "SERVE_TOPK from the environment; flags win)")
    muxp.add_argument("expert_cache", nargs="?", type=int, default=None,
                      help="experts per MoE layer on the device (EXPERT_CAP; 0 or absent: no limit)")
    _add_expert_flags(muxp)
    muxp.add_argument("--kv-slots", type=int, default=None, help="KV slots, 1-16 (KV_SLOTS; default 1)")
    muxp.add_argument("--topk", action="store_true", default=None, help="a TOPK line per token (SERVE_TOPK=1)")
    muxp.add_argument("--batch", action="store_true", help="the mux protocol even without SERVE_BATCH=1")
    muxp.add_argument("--ngen", type=int, default=None,
                      help="legacy protocol: tokens per answer to a chat line (NGEN; default 256)")
    _add_model_flags(muxp)
    muxp.add_argument("--kv-save-dir", type=Path, default=None,
                      help="where each slot's session persists (KVSAVE_DIR; default ~/.cache/motet/sessions; "
                      "KVSAVE=0 turns persistence off)")
    muxp.add_argument("--temperature", type=float, default=0.0, help="legacy protocol chat lines: 0 = greedy")
    muxp.add_argument("--top-p", type=float, default=1.0, help="legacy protocol chat lines")
    _add_group_flags(muxp)
    _add_warm_up_flag(muxp)
    servep = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (and the web page)")
    servep.add_argument("--host", default="127.0.0.1")
    servep.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    servep.add_argument("--kv-slots", type=int, default=16)
    servep.add_argument("--api-key", default=None, help="required on /v1, /experts, /metrics (MOTET_API_KEY)")
    servep.add_argument("--allow-insecure-bind", action="store_true",
                        help="serve on a non-loopback address without an API key")
    servep.add_argument("--cors-origin", action="append", default=[], help="an allowed origin (repeatable)")
    servep.add_argument("--max-body-bytes", type=int, default=1 << 20)
    servep.add_argument("--queue-limit", type=int, default=64, help="requests waiting for a slot (past it: 429)")
    servep.add_argument("--web-dir", type=Path, default=None,
                        help="the folder served at / (default: the page shipped in the package, motet/web/)")
    servep.add_argument("--engine-cmd", default=None, help='a mux engine to drive, e.g. "motet mux"')
    servep.add_argument("--tool-parser", choices=TOOL_FAMILIES, default=None,
                        help="the format of the model's tool calls (default: the one its chat template asks for)")
    servep.add_argument("--send-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="close a connection whose client takes no bytes of an answer for this long "
                        "(its request is cancelled, its slot freed)")
    servep.add_argument("--split", default=None, metavar="JSON",
                        help='split serving: a prefill and a decode engine, e.g. \'{"prefill_device": 0, '
                        '"decode_device": 1, "min_prompt_tokens": 2048}\' (\'{}\': defaults; README)')
    servep.add_argument("--slot-save-path", type=Path, default=None,
                        help="the folder of POST /slots/{id}?action=save|restore files (created if missing)")
    servep.add_argument("--expert-cap", dest="expert_cache", type=int, default=None,
                        help="experts per MoE layer on the device (EXPERT_CAP; 0 or absent: no limit)")
    _add_expert_flags(servep)
    _add_model_flags(servep)
    _add_group_flags(servep)
    _add_warm_up_flag(servep)
    workerp = sub.add_parser("worker", help="a prefill, decode or mono worker on the TCP wire (docs/wire.md)")
    workerp.add_argument("--role", choices=("mono", "prefill", "decode"), required=True)
    workerp.add_argument("--listen", required=True, metavar="HOST:PORT",
                         help="where to listen (port 0 picks a free one; 'listening on HOST:PORT' goes to stderr)")
    workerp.add_argument("--kv-slots", type=int, default=4, help="KV slots, 1-16: requests served at once")
    workerp.add_argument("--request-wait", type=float, default=600.0,
                         help="seconds a decode worker waits for its prefill worker (default 600)")
    workerp.add_argument("--prefill", default=None, metavar="HOST:PORT",
                         help="decode: the prefill worker (a request's prefill= key wins)")
    _add_model_flags(workerp)
    _add_warm_up_flag(workerp)
    return parser
