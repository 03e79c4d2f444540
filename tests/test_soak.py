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
    rss = r["rss_mib_by_fifth"]  # allocator pools settle early (a step up, then flat); a leak keeps growing
    assert rss[-1] - rss[2] <= 32 and rss[-1] <= rss[0] * 1.25 + 64, rss
