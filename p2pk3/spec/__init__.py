"""Speculative decoding: the entry drafts k tokens per session (proposers.py, cheap: no model), the ring
verifies them in one pass (every stage runs them as k + 1 more positions of the session), the last stage
accepts the longest prefix the target itself would have produced (verify.py) and every stage rolls back
the rejected ones before the session's next segment (model/cache.py Checkpoint, K3Stage.rollback).
draft_len.py picks k per session from its recent acceptance and the measured cost of passes by width."""

from .draft_len import DraftLength, PassCost
from .proposers import NgramProposer, SuffixIndex, SuffixProposer, make_proposer
from .verify import verify_draft

__all__ = ["DraftLength", "PassCost", "NgramProposer", "SuffixIndex", "SuffixProposer", "make_proposer", "verify_draft"]
