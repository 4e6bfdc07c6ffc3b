"""Once a model is loaded, its file's pages no longer count in the process's resident set
(model/mapped_file.py): loading reads every byte through a mapping that outlives the
load, so without this the file counted twice, once as pages and once as weights."""

from __future__ import annotations

import re
from pathlib import Path

from motet.model import load_model


def resident_bytes_of(path: Path) -> int:
    """The resident bytes of every mapping of `path` in this process (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
                inside = line.rstrip().endswith(str(path))
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_a_loaded_gguf_leaves_its_pages_to_the_page_cache(default_model_file):
    model = load_model(default_model_file)
    size = default_model_file.stat().st_size
    # before: 93 of the file's 98 MB stayed resident (the float32 norms share its memory)
    assert resident_bytes_of(default_model_file) < 0.02 * size
    # the pages a float tensor shares come back from the file when read
    logits = model.logits([1, 2, 3])
    assert logits.shape == (3, model.config.vocab_size) and abs(logits).max() > 0

