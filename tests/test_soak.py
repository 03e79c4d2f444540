"""A CI-sized soak (tests/soak.py; `make soak` runs a long one): mixed requests with random
disconnects under KV pressure, then nothing lost, nothing leaked, the block manager consistent."""
import os

import pytest

import soak

pytestmark = pytest.mark.slow


def test_a_soak_loses_nothing_and_leaks_nothing():
    requests = int(os.environ.get("TOKENMILL_SOAK_REQUESTS", "300"))
    r = soak.run(requests=requests, concurrency=24, seed=1, max_new=48)
    print(r)
    assert r["lost"] == 0, r["errors"]
    assert r["completed"] + r["cancelled"] == r["requests"] == requests
    assert r["cancelled"] > 0 and r["streams"] > 0 and r["n_gt_1"] > 0 and r["with_stop"] > 0
    assert r["preemptions"] > 0  # the cache was small enough to force them
    assert r["leaked_requests"] == r["leaked_streams"] == r["leaked_blocks"] == 0
    assert r["block_integrity"] == "ok"
    # allocator pools settle (then flat); a leak keeps growing. Since weights load without a float
    # staging copy the process starts lean and the serving heap fills over the first ~600 requests
    # (1,000 requests, session 20: 610, 664, 709, 719, 719 MiB by fifth, below the 740-762 of
    # the staging loader). Anonymous memory: the resident total also grows by the embedding table's
    # file pages as new tokens are looked up (the default model's table: 30 MB), the page cache's.
    # Over the last three fifths of 300 requests, alone on the 2-core VM (session 21): 5d4f3e2's
    # total 56 MiB; this loader's anonymous 52, 63 and one run just over 64: 80 is that settling
    # with its spread. `make soak` (thousands of requests) is the leak check
    anon = r["anon_mib_by_fifth"]
    assert anon[-1] - anon[2] <= 80 and anon[-1] <= anon[0] * 1.25 + 64, anon
