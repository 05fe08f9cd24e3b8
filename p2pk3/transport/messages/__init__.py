"""Every frame kind, built and parsed here: one builder and one parser per kind (docs/protocol.md
lists them all, with their fields). Import them from `p2pk3.transport.messages`; the modules split
them by who talks:

* ring.py: between daemons along the ring: `forward`, `result`, `free`, `ping` / `pong`;
* client.py: any authenticated peer <-> the entry: `generate`, `token`, `done`, `cancel`, `status`, `error`;
* control.py: slot claims (`claim`, `claim_result`), failure handling (`takeover`, `route`, `retain`,
  `handover`) and the spare pool (`join` -> `joined`);
* files.py: file sharing between nodes (`file_list` -> `file_index`, `file_get` -> `file_chunk`);
* fields.py: the field checks they share, and the error codes.

(`hello` / `auth`, the handshake, are built and checked by transport/connection.py.)

Builders raise ValueError on bad arguments (our own bug); parsers raise ProtocolError on anything a
peer could have sent wrong, naming the frame and the field, so receivers reject it before acting on
it. Where a well-formed request has invalid contents that the receiver answers rather than closing
the connection for (`generate`, `file_get`), the parser raises ValueError for those.
"""

from .client import (
    MAX_PROMPT,
    Done,
    ErrorReply,
    GenerateRequest,
    cancel_frame,
    done_frame,
    error_frame,
    parse_cancel,
    parse_done,
    parse_error,
    parse_status,
    parse_token,
    parse_token_logprob,
    status_frame,
    token_frame,
)
from .control import (
    CLAIM_CODES,
    CLAIM_OPS,
    ClaimHolder,
    ClaimMessage,
    ClaimResult,
    Route,
    claim_frame,
    claim_result_frame,
    join_frame,
    joined_frame,
    parse_claim,
    parse_claim_result,
    parse_join,
    parse_joined,
    parse_retain,
    parse_route,
    parse_takeover,
    parse_handover,
    retain_frame,
    route_frame,
    takeover_frame,
    handover_frame,
)
from p2pk3.params import TokenLogprob

from .fields import MAX_SESSION_ID, ErrorCode
from .files import (
    FILE_CHUNK,
    FileChunk,
    FileGet,
    FileIndex,
    FileInfo,
    file_chunk_frame,
    file_get_frame,
    file_index_frame,
    file_list_frame,
    parse_file_chunk,
    parse_file_get,
    parse_file_index,
    parse_file_list,
)
from .ring import (
    Forward,
    Keep,
    PrefixReport,
    Result,
    Segment,
    forward_frame,
    free_frame,
    parse_forward,
    parse_free,
    parse_free_keep,
    parse_prefix_report,
    parse_result,
    parse_pong,
    ping_frame,
    pong_frame,
    prefix_report_frame,
    result_frame,
)

__all__ = [
    "ErrorCode",
    "MAX_SESSION_ID",
    "MAX_PROMPT",
    "TokenLogprob",
    # ring
    "Segment",
    "Forward",
    "Result",
    "forward_frame",
    "parse_forward",
    "result_frame",
    "parse_result",
    "free_frame",
    "parse_free",
    "ping_frame",
    "pong_frame",
    "parse_pong",
    "Keep",
    "parse_free_keep",
    "PrefixReport",
    "prefix_report_frame",
    "parse_prefix_report",
    # clients
    "GenerateRequest",
    "token_frame",
    "parse_token",
    "parse_token_logprob",
    "Done",
    "done_frame",
    "parse_done",
    "cancel_frame",
    "parse_cancel",
    "status_frame",
    "parse_status",
    "ErrorReply",
    "error_frame",
    "parse_error",
    # claims and failure handling
    "CLAIM_OPS",
    "CLAIM_CODES",
    "ClaimMessage",
    "ClaimHolder",
    "ClaimResult",
    "claim_frame",
    "parse_claim",
    "claim_result_frame",
    "parse_claim_result",
    "takeover_frame",
    "parse_takeover",
    "handover_frame",
    "parse_handover",
    "Route",
    "route_frame",
    "parse_route",
    "retain_frame",
    "parse_retain",
    "join_frame",
    "parse_join",
    "joined_frame",
    "parse_joined",
    # file sharing
    "FILE_CHUNK",
    "FileInfo",
    "FileIndex",
    "FileGet",
    "FileChunk",
    "file_list_frame",
    "parse_file_list",
    "file_index_frame",
    "parse_file_index",
    "file_get_frame",
    "parse_file_get",
    "file_chunk_frame",
    "parse_file_chunk",
]
