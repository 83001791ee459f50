"""The limits of one Clef record, the original stack's (research/serving.md A.4): what a systemone
body may hold (qv/clef/request.py checks them) and what the engine plans memory for (head.py)."""

MAX_QUESTIONS = 64
MAX_OPTIONS_PER_QUESTION = 256
MAX_OPTIONS_TOTAL = 448
MAX_IMAGES = 16  # `images` and `assets` together
MAX_JSON_DEPTH = 128  # nesting of the body's JSON values (state, instructions, criteria)
MAX_JSON_CONTAINERS = 1 << 18  # objects and arrays in one body: a state of more renders past any record cap
