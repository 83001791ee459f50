"""One log format for qv's loggers and uvicorn's (`qv serve`), and the access-log filter that leaves out the
/health and /metrics probes (access_log=api, the default), which would otherwise drown the log."""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
PROBE_PATHS = {"/health", "/metrics"}


class SkipProbes(logging.Filter):
    """Drops uvicorn's access records of probe paths (its args: client, method, path, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (len(args) >= 3 and str(args[2]).split("?", 1)[0] in PROBE_PATHS)


def log_config(level: str, access_log: str) -> dict:
    """logging.config.dictConfig for uvicorn.Config(log_config=...): every logger through one handler and
    format; uvicorn's loggers propagate to it instead of keeping their own formats."""
    level = level.upper()
    access = {"level": level, "handlers": [], "propagate": True}
    if access_log == "api":
        access["filters"] = ["probes"]
    return {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"qv": {"format": LOG_FORMAT}},
        "filters": {"probes": {"()": SkipProbes}},
        "handlers": {"default": {"class": "logging.StreamHandler", "formatter": "qv", "stream": "ext://sys.stderr"}},
        "root": {"handlers": ["default"], "level": level},
        "loggers": {"uvicorn": {"level": level, "handlers": [], "propagate": True},
                    "uvicorn.error": {"level": level, "handlers": [], "propagate": True},
                    "uvicorn.access": access},
    }
