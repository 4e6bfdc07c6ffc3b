"""The mux line protocol (see docs in the seeds' mux-protocol.md), as sans-IO codecs.

Each direction has a decoder that takes bytes as they arrive (split anywhere) and
returns typed events, and encoder functions that turn events into bytes. No I/O here:
the stdio bridge and the mux client move the bytes.

    server → engine:  SUBMIT, CANCEL, STOP           RequestDecoder / encode_submit ...
                      SAVE, RESTORE, ERASE, PREFILL  [extension] encode_save ...
    engine → server:  READY, DATA, TOPK, DONE, ERROR, telemetry lines
                                                     ResponseDecoder / encode_data ...
                      SAVED, RESTORED, ERASED, PREFILLED, KVSAVE_FAIL, WARMUP,
                      ERROR .. SESSION_REFUSED       [extension] ExtendedResponseDecoder
"""

from __future__ import annotations

from .extension import (  # noqa: F401 - the protocol's names, as mux.X
    Erased,
    ExtendedResponseDecoder,
    KvSaveFail,
    LoadFail,
    Prefilled,
    Restored,
    Saved,
    SessionRefused,
    Turn,
    Warmup,
    encode_erased,
    encode_kvsave_fail,
    encode_prefilled,
    encode_restored,
    encode_saved,
    encode_session_refused,
    encode_warmup,
)
from .grammar import grammar_from_wire, grammar_to_wire  # noqa: F401 - the protocol's names, as mux.X
from .lines import (  # noqa: F401 - the protocol's names, as mux.X
    MAX_DATA,
    MAX_LINE,
    MAX_PATH,
    MAX_PAYLOAD,
    READY,
    LineBuffer,
)
from .requests import (  # noqa: F401 - the protocol's names, as mux.X
    BadFrame,
    Cancel,
    Erase,
    Malformed,
    Prefill,
    RequestDecoder,
    RequestReader,
    Restore,
    Save,
    Stop,
    Submit,
    encode_cancel,
    encode_erase,
    encode_prefill,
    encode_restore,
    encode_save,
    encode_stop,
    encode_submit,
)
from .responses import (  # noqa: F401 - the protocol's names, as mux.X
    TELEMETRY_KINDS,
    BadLine,
    Data,
    Done,
    Error,
    Ready,
    ResponseDecoder,
    Telemetry,
    TopK,
    encode_data,
    encode_done,
    encode_error,
    encode_ready,
    encode_telemetry,
    encode_topk,
)
