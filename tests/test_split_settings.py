"""Split serving's settings (runtime/split_settings.py) and every refusal with its
sentence, its statistics' Prometheus names, and the slot table alone (runtime/slot_table.py);
test_split.py runs two real `motet mux` children."""

from __future__ import annotations

import json

import pytest
import trio
import trio.testing

from motet.runtime.api import SplitStatistics
from motet.runtime.errors import BadRequest, QueueFull, SlotBusy
from motet.runtime.slot_table import SlotQueue
from motet.runtime.split_settings import SplitConfigError, SplitSettings

# ---- settings ------------------------------------------------------------------------


def test_defaults_and_a_full_setting():
    assert SplitSettings.from_dict({}) == SplitSettings()
    s = SplitSettings()
    assert (s.prefill_device, s.decode_device, s.min_prompt_tokens, s.dir) == (None, None, 2048, None)
    s = SplitSettings.from_json(json.dumps({
        "prefill_device": 0, "decode_device": 1, "min_prompt_tokens": 512, "dir": "/tmp/x",
        "prefill_args": ["RAM_GB=8", "--experts=tiered", "--dtype=bfloat16"],
        "decode_args": ["--no-prefetch", "--dtype=bfloat16", "KVSAVE=1"],
    }))
    assert (s.prefill_device, s.decode_device, s.min_prompt_tokens, str(s.dir)) == (0, 1, 512, "/tmp/x")
    assert dict(s.prefill_args.env) == {"RAM_GB": "8"}
    assert s.prefill_args.flags == ("--experts=tiered", "--dtype=bfloat16")
    assert dict(s.decode_args.env) == {"KVSAVE": "1"}
    assert s.decode_args.flags == ("--no-prefetch", "--dtype=bfloat16")


REFUSALS = [
    ([0, 1], r"must be a JSON object such as"),
    ({"prefill_gpu": 0}, r"have no key 'prefill_gpu'; the known keys are prefill_device, decode_device, "
                         r"min_prompt_tokens, dir, prefill_args, decode_args\."),
    ({"prefill_device": 1, "decode_device": 1},
     r"prefill_device and decode_device are both accelerator 1; each engine needs an accelerator of its own\."),
    ({"prefill_device": 0}, r"give both prefill_device and decode_device, or neither"),
    ({"prefill_device": -1, "decode_device": 1}, r"prefill_device must be an accelerator number \(0 or more\), "
                                                 r"not -1\."),
    ({"prefill_device": True, "decode_device": 1}, r"prefill_device must be an accelerator number .* not True"),
    ({"prefill_device": "0", "decode_device": 1}, r"prefill_device must be an accelerator number .* not '0'"),
    ({"min_prompt_tokens": 0}, r"min_prompt_tokens must be a whole number of tokens \(1 or more\), not 0\."),
    ({"min_prompt_tokens": -5}, r"min_prompt_tokens must be .* not -5"),
    ({"min_prompt_tokens": 2.5}, r"min_prompt_tokens must be .* not 2\.5"),
    ({"min_prompt_tokens": "2048"}, r"min_prompt_tokens must be .* not '2048'"),
    ({"dir": ""}, r"dir must be the name of a folder, not ''\."),
    ({"dir": 5}, r"dir must be the name of a folder, not 5\."),
    ({"prefill_args": "RAM_GB=8"}, r"prefill_args must be a list of strings"),
    ({"decode_args": [8]}, r"decode_args holds 8, which is not a string"),
    ({"decode_args": ["8"]}, r"decode_args holds '8', which is neither KEY=VALUE nor --flag\[=value\]; "
                             r"write a flag and its value as one entry"),
    ({"decode_args": ["ram_gb=8"]}, r"neither KEY=VALUE nor --flag"),
    ({"prefill_args": ["--layer-split=2"]}, r"prefill_args holds --layer-split, which is not a motet mux flag "
                                            r"a role can take \(those are --experts, "),
    ({"prefill_args": ["SERVE_TOPK=0"]}, r"prefill_args cannot set SERVE_TOPK: the split talks to its engines "
                                         r"through the mux protocol"),
    ({"decode_args": ["--batch"]}, r"decode_args cannot set --batch"),
    ({"decode_args": ["CUDA_VISIBLE_DEVICES=3"]},
     r"decode_args cannot set CUDA_VISIBLE_DEVICES: each engine's accelerator is given by prefill_device"),
    ({"prefill_args": ["CTX=512"]}, r"prefill_args and decode_args set CTX / --max-context differently \('512' "
                                    r"and unset\): both engines must agree on the context length, since a "
                                    r"session file only restores into an engine of the same weights and KV "
                                    r"shape\."),
    ({"prefill_args": ["CTX=1024"], "decode_args": ["--max-context=512"]},
     r"set CTX / --max-context differently \('1024' and '512'\)"),
    ({"decode_args": ["KV_SLOTS=2"]}, r"KV_SLOTS / --kv-slots differently .* the number of KV slots"),
    ({"prefill_args": ["--dtype=bfloat16"]}, r"--dtype differently \('bfloat16' and unset\).* the weights' dtype"),
    ({"decode_args": ["--kv-dtype=float32"]}, r"--kv-dtype differently \(unset and 'float32'\).* the KV cache's dtype"),
    ({"decode_args": ["SNAP=/other/model.gguf"]}, r"SNAP / --model differently .* agree on the model"),
    ({"prefill_args": ["JAX_PLATFORMS=cpu"]}, r"JAX_PLATFORMS differently .* the JAX backend"),
    ({"prefill_args": ["KVSAVE=1"]}, r"prefill_args cannot set KVSAVE: the prefill engine's slots only pass"),
]


@pytest.mark.parametrize("raw, message", REFUSALS)
def test_every_refusal_says_why(raw, message):
    with pytest.raises(SplitConfigError, match=message):
        SplitSettings.from_dict(raw)


def test_refusals_that_need_json_or_a_file(tmp_path):
    with pytest.raises(SplitConfigError, match=r"the split settings are not valid JSON \(.*\); write them as"):
        SplitSettings.from_json("{prefill_device: 0}")
    (tmp_path / "f").write_text("")
    with pytest.raises(SplitConfigError, match=r"dir '.*f' is a file, not a folder for session files\."):
        SplitSettings.from_dict({"dir": str(tmp_path / "f")})
    with pytest.raises(SplitConfigError, match="both accelerator 2"):
        SplitSettings(prefill_device=2, decode_device=2)  # checked however it is built
    assert issubclass(SplitConfigError, ValueError)


def test_the_same_value_in_both_roles_is_no_mismatch_and_a_flag_wins():
    s = SplitSettings.from_dict({"prefill_args": ["CTX=512"], "decode_args": ["--max-context=512"]})
    assert s.prefill_args.value("CTX", "--max-context") == "512"
    s = SplitSettings.from_dict({"prefill_args": ["CTX=1024", "--max-context=512"], "decode_args": ["CTX=512"]})
    assert s.decode_args.value("CTX", "--max-context") == "512"


def test_the_session_folder_is_fresh(tmp_path):
    given = SplitSettings(dir=tmp_path / "sessions")
    a, b = given.make_dir(), given.make_dir()
    assert a != b and a.parent == b.parent == tmp_path / "sessions"
    default = SplitSettings().make_dir()
    try:
        assert default.is_dir() and default.name.startswith("motet-split-")
    finally:
        default.rmdir()


def test_statistics_map_to_prometheus_names():
    stats = SplitStatistics(5, 2, 1, 2, 1000, 1500.0, 20.0, 30.0, True, False, 1, 8, None)
    metrics = {name: (kind, value) for name, kind, _, value in stats.metrics()}
    assert metrics["motet_split_handovers"] == ("counter", 2)
    assert metrics["motet_split_prefill_seconds"] == ("counter", 1.5)
    assert metrics["motet_split_decode_alive"] == ("gauge", 0.0)
    assert all(not name.endswith("_total") for name in metrics)
    assert len(metrics) == len(stats.metrics())


# ---- the slot table ------------------------------------------------------------------


async def test_slot_queue_chooses_as_the_scheduler_and_queues_in_order():
    with trio.fail_after(10):
        table = SlotQueue(2, queue_limit=1)
        a = await table.take((1, 2, 3))
        table.give_back(a, (1, 2, 3, 4))
        assert await table.take((1, 2, 3, 9)) == a  # the longest shared prefix
        b = await table.take((7, 7))
        assert b != a
        with pytest.raises(SlotBusy):
            await table.take((5,), slot=b)
        with pytest.raises(BadRequest):
            await table.take((5,), slot=2)
        got = []

        async def waiter(*, task_status=trio.TASK_STATUS_IGNORED):
            task_status.started()
            got.append(await table.take((5, 5)))

        async with trio.open_nursery() as nursery:
            await nursery.start(waiter)
            await trio.testing.wait_all_tasks_blocked()
            assert table.waiting == 1
            with pytest.raises(QueueFull):
                await table.take((6,))
            table.give_back(b)
        assert got == [b] and table.busy == {a, b}


async def test_a_cancelled_waiter_leaves_the_queue():
    with trio.fail_after(10):
        table = SlotQueue(1, queue_limit=1)
        slot = await table.take((1,))
        got = []
        first = trio.CancelScope()

        async def one():
            with first:
                await table.take((2,))

        async def two():
            got.append(await table.take((3,)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(one)
            await trio.testing.wait_all_tasks_blocked()
            first.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert table.waiting == 0
            nursery.start_soon(two)  # the queue has room again
            await trio.testing.wait_all_tasks_blocked()
            table.give_back(slot)
        assert got == [slot] and table.busy == {slot}


def test_the_cli_refuses_a_bad_split_before_loading_anything(capsys):
    from motet.cli import main

    assert main(["serve", "--split", '{"prefill_gpu": 0}']) == 2
    assert "the split settings have no key 'prefill_gpu'" in capsys.readouterr().err
