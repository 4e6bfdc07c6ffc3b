"""Once a model is loaded, its file's pages no longer count in the process's resident set
(model/mapped_file.py), and while it loads only one layer's do: loading reads every byte
through a mapping that outlives the load, so without this the file counted twice, once
as pages and once as weights."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

# Probes run in a fresh process, so no other test's mapping of the same file is counted.
RESIDENT = r'''
import re, sys
from pathlib import Path
from motet.model import gguf_file, load_model

def resident_bytes_of(path):
    """The resident bytes of every mapping of `path` in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total
'''

PROBE = RESIDENT + r'''
path = Path(sys.argv[1])
model = load_model(path)
after_load = resident_bytes_of(path)
logits = model.logits([1, 2, 3])  # a step reads every tensor again
after_step = resident_bytes_of(path)
print(after_load, after_step, path.stat().st_size, logits.shape[0], float(abs(logits).max()))
'''


def test_a_loaded_gguf_leaves_its_pages_to_the_page_cache(default_model_file):
    out = subprocess.run([sys.executable, "-c", PROBE, str(default_model_file)], capture_output=True, text=True,
                         cwd=REPO, timeout=300, check=True).stdout.split()
    resident, after_step, size, rows, largest = int(out[0]), int(out[1]), int(out[2]), int(out[3]), float(out[4])
    # before: 93 of the file's 98 MB stayed resident (the float32 norms share its memory)
    assert resident < 0.02 * size
    # and a step brings none back: the norms were copied out of the file, not views of it
    assert after_step < 0.01 * size, after_step
    assert rows == 3 and largest > 0


# The file's resident bytes each time the load drops its pages (and once loaded).
DURING_LOAD = RESIDENT + r'''
path = Path(sys.argv[1])
seen = []
release = gguf_file.GGUFSource.release_pages
def measured(self):
    seen.append(resident_bytes_of(path))
    release(self)
gguf_file.GGUFSource.release_pages = measured
model = load_model(path)
print(path.stat().st_size, model.config.n_layers, *seen)
'''


def test_the_load_holds_one_layer_of_the_file_at_a_time(default_model_file):
    """pack_weights drops the pages of what it has built before each layer, so the load
    holds the embedding or about one layer of the file at a time, not all of it (before,
    the MoE Q8_0 benchmark file's load peaked at 1076-1114 MB, 460 of them its pages)."""
    out = subprocess.run([sys.executable, "-c", DURING_LOAD, str(default_model_file)], capture_output=True,
                         text=True, cwd=REPO, timeout=300, check=True).stdout.split()
    size, layers, *seen = (int(v) for v in out)
    assert len(seen) == layers + 1  # before each layer, and once loaded
    # the embedding (tied to the head): a third of this file; then a layer at a time (2.3
    # MB) and what the kernel maps around its faults, which varies: 2-4 MB locally, up to
    # 5.2 in a CI clone's fresh install
    assert seen[0] < 0.4 * size and max(seen[1:]) < 0.1 * size, (seen, size)
