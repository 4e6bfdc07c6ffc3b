"""The panel layouts (quant.py's p8 and p4): a matrix's rows 16 at a time, each panel's
values, scales, mins and super entries reordered as the integer kernels read them
(kernels/panels_avx2.inc, panels_vnni.inc), every array keeping the row-major form's shape and bytes, so
whole panels of rows (and a stack's experts) slice as rows do. panels.py says where
they are held."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

PANELS = ("p8", "p4")
PANEL_ROWS = 16
LAYOUT_OF = {"q8": "p8", "q4": "p4"}


def lift(source: str) -> int:
    """What a p8 matrix's bytes hold above its values: 32 over six bits (Q6_K's [-32, 31],
    Q5_K's [0, 31]), 128 over Q8_0's whole int8."""
    return 128 if source == "Q8_0" else 32


def _panel_order(a, lead, n):
    """Entries [..., n, E] (scales, mins, super entries) as [..., panel][E][16]."""
    if a is None:
        return None
    a = np.asarray(a)
    entries = a.shape[-1]
    grouped = a.reshape(*lead, n // PANEL_ROWS, PANEL_ROWS, entries).swapaxes(-1, -2)
    return np.ascontiguousarray(grouped).reshape(*lead, n, entries)


def as_panels(w):
    """A q8 matrix of Q6_K, Q5_K or Q8_0 blocks (or a stack of them) as p8, or a q4 one of
    Q4_K, Q4_1 or Q4_0 blocks as p4, on the host. Panel p is rows 16p to 16p + 15:
      p8  values [K/4][16] dwords, four values of a row plus their lift (as unsigned bytes)
      p4  values a block of 32 at a time, [j 4][h 2][column 8][4] bytes: quad j (values 4j
          to 4j + 3) of columns 8h to 8h + 7 in the low nibbles, quad j + 4 in the high
    and scales, mins [K/block][16] and super entries [K/block/group][16]."""
    # Both moves are of whole dwords: a q4 block's dword j already holds quad j (its low
    # nibbles: values 4j to 4j + 3) and quad j + 4 (the high ones: values 4j + 16 on).
    values = np.ascontiguousarray(w.values)
    *lead, n, row_bytes = values.shape
    panels, dwords = n // PANEL_ROWS, values.view(np.uint32)
    if w.layout == "q8":  # [panels, column, K/4] to [panels, K/4, column]
        held = np.ascontiguousarray(dwords.reshape(*lead, panels, PANEL_ROWS, row_bytes // 4).swapaxes(-1, -2))
        held = held.view(np.uint8).reshape(*lead, n, row_bytes)
        held += np.uint8(lift(w.source))  # as unsigned bytes: up to 63 over six bits, 255 over eight
    else:  # [panels, h, column, block, j] to [panels, block, j, h, column]
        d = dwords.reshape(*lead, panels, 2, 8, row_bytes // 16, 4)
        order = (*range(len(lead)), *(len(lead) + i for i in (0, 3, 4, 1, 2)))
        held = np.ascontiguousarray(d.transpose(order)).view(np.uint8).reshape(*lead, n, row_bytes)
    return replace(w, values=held, scale=_panel_order(w.scale, lead, n), min=_panel_order(w.min, lead, n),
                   super_scale=_panel_order(w.super_scale, lead, n), super_min=_panel_order(w.super_min, lead, n),
                   layout=LAYOUT_OF[w.layout])


def rows_of_panels(w):
    """A p8 or p4 matrix as the q8 or q4 one it holds (numpy, or inside jit): each panel's
    values, scales, mins and super entries back in row order."""
    *lead, n, k = w.values.shape
    panels = n // PANEL_ROWS

    def rows(a):
        if a is None:
            return None
        entries = a.shape[-1]
        return a.reshape(*lead, panels, entries, PANEL_ROWS).swapaxes(-1, -2).reshape(*lead, n, entries)

    if w.layout == "p8":  # [K/4][16] dwords of four values plus their lift
        v = w.values.reshape(*lead, panels, k // 4, PANEL_ROWS, 4).swapaxes(-3, -2).reshape(*lead, n, k)
        values, layout = (v.astype(np.int16) - lift(w.source)).astype(np.int8), "q8"
    else:  # a block of 32: [j 4][h 2][column 8][4] bytes, quad j low, quad j + 4 high
        blocks = k // 16  # k is bytes here, two values each
        v = w.values.reshape(*lead, panels, blocks, 4, 2, 8, 4)
        q = (v[..., None] >> np.array([0, 4], np.uint8)) & 15
        # [panels, block, j, h, column, value, half] to [panels, h, column, block, half, j, value]
        q = q.transpose(*range(len(lead)), *(len(lead) + i for i in (0, 3, 4, 1, 6, 2, 5)))
        q = q.reshape(*lead, n, blocks, 2, 16)
        values, layout = (q[..., 0, :] | (q[..., 1, :] << 4)).reshape(*lead, n, k), "q4"
    return replace(w, values=values, scale=rows(w.scale), min=rows(w.min), super_scale=rows(w.super_scale),
                   super_min=rows(w.super_min), layout=layout)
