"""Speculative decoding: draft k tokens cheaply (the checkpoint's MTP head, or n-gram lookup in the
sequence so far), verify all k+1 positions in one target forward, keep the accepted prefix."""
