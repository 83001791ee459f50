"""Clef decisions (POST /v1/systemone) on the served weights: record encoding and limits
(encode.py, request.py), the joint schema head (head.py), answers (answers.py), the weight
layouts and low-rank deltas (adapters.py), and an engine-free driver (offline.py)."""
