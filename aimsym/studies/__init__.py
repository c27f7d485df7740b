"""Studies: sweeps over a grid, the resumable result store."""

from __future__ import annotations

import json


def read_records(path, key) -> dict:
    """Records of a JSON-lines file written one per finished run, by ``key(record)``: what a
    resumed series reuses (an absent file or None: nothing yet)."""
    done = {}
    if path is None:
        return done
    try:
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                done[key(r)] = r
    except FileNotFoundError:
        pass
    return done
