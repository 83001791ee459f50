"""Clef decisions (POST /v1/systemone) on the served weights: the request's one validation and its
encoding (request.py, with the limits in limits.py and the record encoder in encode.py), the joint
schema head (head.py), answers (answers.py), the weight layouts and low-rank deltas (adapters.py),
and an engine-free driver (offline.py). Above the engine, the server and the offline LLM parse requests
(request.py, limits.py) and format answers (answers.py) themselves; the rest is the engine's."""
