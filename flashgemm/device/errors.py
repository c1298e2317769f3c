"""The bits of the int32 error word the signalled and expert-parallel kernels
OR into (one word per call or layer; ``ep.combine.ERROR_BITS`` says them in
words)."""

ERR_TIMEOUT = 1  # a wait on a completion signal ran out of polls
ERR_BAD_ROUTE = 2  # a routing entry (token, rank, slot) out of range: that row skipped
ERR_PEER_TIMEOUT = 4  # a peer did not report completion in time
ERR_PEER_FAILED = 8  # a peer reported an error of its own
ERR_OVERFLOW = 16  # an expert received more rows than its capacity
ERR_SEQUENCE = 32  # a peer arrived with another sequence number
