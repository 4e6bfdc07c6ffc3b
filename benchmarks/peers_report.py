"""benchmarks/peers.py's figures: each round's (the best of each engine's timed runs,
and their ratios, motet / llama.cpp), and over several rounds the median of each figure
and of each ratio, with the ratios' range. A round runs both engines one after the
other; the rounds alternate which goes first, so a machine that slows or speeds up over
minutes moves both engines' figures, and a ratio is taken within a round."""

from __future__ import annotations

import statistics

# (key, label, how to read it from a summary)
FIGURES = (
    ("single_decode", "decode, 1 stream (tok/s)", lambda s: s["single"]["decode_tok_s"]),
    ("streams_decode", "decode, {streams} streams (tok/s)", lambda s: s["streams"]["aggregate_decode_tok_s"]),
    ("streams_wall_time", "{streams} streams, wall (s)", lambda s: s["streams_wall_s"]),
    ("prefill", "prefill, {prefill} tokens (tok/s)", lambda s: s["prefill"]["tok_s"]),
    ("peak_rss", "peak RSS (MB)", lambda s: s["peak_rss_mb"]),
)


def best(runs: list[dict], scenario: str, key: str, lower: bool = False) -> dict:
    return (min if lower else max)((r[scenario] for r in runs), key=lambda r: r[key])


def agreement(a: list[int], b: list[int]) -> int:
    """Greedy tokens the two engines share before they first differ."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def summarize(child: dict) -> dict:
    """One engine's child: the best of its timed runs (run 0 is untimed), its peak RSS."""
    runs = child["runs"][1:]
    single = {k: v for k, v in best(runs, "single", "decode_tok_s").items() if k != "tokens"}
    return {"single": single, "streams": best(runs, "streams", "aggregate_decode_tok_s"),
            "streams_wall_s": best(runs, "streams", "wall_s", lower=True)["wall_s"],
            "prefill": best(runs, "prefill", "tok_s"), "peak_rss_mb": child["peak_rss_mb"]}


def one_round(ours: dict, peer: dict, first: str) -> dict:
    """Both engines' children of one round: their figures, ratios and greedy agreement."""
    m, p = summarize(ours), summarize(peer)
    token_ms = 1e3 / m["single"]["decode_tok_s"]
    m["bare_step_ms"], m["token_interval_ms"] = ours["bare_step_ms"], token_ms
    m["overhead_ms"] = token_ms - ours["bare_step_ms"]
    # at 16 streams, a step of all of them (older reports lack these)
    streams = len(m["streams"]["generated_per_stream"])
    m["all_decoding_tok_s"] = m["streams"].get("all_decoding_tok_s", float("nan"))
    m["streams_step_ms"] = streams * 1e3 / m["all_decoding_tok_s"] if m["all_decoding_tok_s"] else float("nan")
    m["bare_streams_step_ms"] = ours.get("bare_streams_step_ms", float("nan"))
    m["streams_overhead_ms"] = m["streams_step_ms"] - m["bare_streams_step_ms"]
    return {"first": first, "motet": m, "llama_cpp": p,
            "ratios": {key: read(m) / read(p) for key, _, read in FIGURES},
            "greedy_agreement_tokens": [agreement(a["single"]["tokens"], b["single"]["tokens"])
                                        for a, b in zip(ours["runs"][1:], peer["runs"][1:])]}


def combine(rounds: list[dict]) -> dict:
    """Over the rounds: each figure's median per engine, each ratio's median and range."""
    def median(side: str, read) -> float:
        return statistics.median(read(r[side]) for r in rounds)

    return {
        "motet": {key: median("motet", read) for key, _, read in FIGURES},
        "llama_cpp": {key: median("llama_cpp", read) for key, _, read in FIGURES},
        "ratios": {key: statistics.median(r["ratios"][key] for r in rounds) for key, _, _ in FIGURES},
        "ratio_ranges": {key: (min(r["ratios"][key] for r in rounds), max(r["ratios"][key] for r in rounds))
                         for key, _, _ in FIGURES},
    }


def table(heading: str, rounds: list[dict], combined: dict, *, streams: int, prefill: int, new_tokens: int) -> str:
    """The file's table: medians over the rounds, each ratio's range beside it."""
    lines = [heading, f"{'':<30} {'motet':>8} {'llama.cpp':>9} {'ratio':>6}  ratio per round"]
    for key, label, _ in FIGURES:
        a, b, ratio = combined["motet"][key], combined["llama_cpp"][key], combined["ratios"][key]
        each = ", ".join(f"{r['ratios'][key]:.2f}" for r in rounds)
        lines.append(f"{label.format(streams=streams, prefill=prefill):<30} {a:>8.1f} {b:>9.1f} {ratio:>6.2f}  {each}")
    for i, r in enumerate(rounds):
        m, peer_streams = r["motet"], r["llama_cpp"]["streams"]["aggregate_decode_tok_s"]
        gen = m["streams"]["generated_per_stream"]
        lines.append(f"round {i} ({r['first']} first): motet generated {m['single']['generated']} (1 stream), "
                     f"{min(gen)}-{max(gen)} per stream ({m['streams']['stopped_early']} stopped early), "
                     f"llama.cpp {new_tokens} everywhere (no EOS stop); motet per token at 1 stream "
                     f"{m['token_interval_ms']:.1f} ms, the bare step one at a time {m['bare_step_ms']:.1f} ms "
                     f"({m['overhead_ms']:+.1f}: the runtime around the step, less what pipelining hides); "
                     f"motet at {streams} streams while all decode {m['all_decoding_tok_s']:.1f} tok/s "
                     f"({m['all_decoding_tok_s'] / peer_streams:.2f}x llama.cpp's), a step "
                     f"{m['streams_step_ms']:.1f} ms, the bare step of {streams} rows "
                     f"{m['bare_streams_step_ms']:.1f} ms ({m['streams_overhead_ms']:+.1f}); "
                     f"greedy tokens shared before the engines diverge {r['greedy_agreement_tokens']}")
    return "\n".join(lines)
