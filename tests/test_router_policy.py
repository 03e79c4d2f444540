"""The router's pieces that need no process: routing policies, the routing key, the data-parallel
launcher's arithmetic and argv, and the re-labelled replica metrics."""

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenmill.cli import build_parser
from tokenmill.router.app import RouterConfig, routing_key
from tokenmill.router.cli import replica_argv
from tokenmill.cpus import core_sets, parse_cores
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policy import Policy, PrefixIndex, chunk_keys

SYSTEM = "You are a meticulous assistant. Answer in full sentences and cite your sources. " * 4


def test_chunk_keys_chain_like_kv_block_keys():
    a = chunk_keys(SYSTEM + "What is the sun?", 16)
    b = chunk_keys(SYSTEM + "Why is the sky blue?", 16)
    n = len(SYSTEM) // 16
    assert a[:n] == b[:n] and len(a) == len((SYSTEM + "What is the sun?")) // 16
    c = chunk_keys("X" + SYSTEM[1:] + "What is the sun?", 16)  # one character early changes every key
    assert not set(a) & set(c)
    assert chunk_keys("short", 16) == []


def test_round_robin_cycles_over_eligible_replicas():
    p = Policy("round_robin", 3)
    picks = [p.choose([], {0: 0, 1: 5, 2: 9}).index for _ in range(6)]
    assert picks == [0, 1, 2, 0, 1, 2]
    assert [p.choose([], {0: 0, 2: 0}).index for _ in range(4)] == [0, 2, 0, 2]


def test_least_load_picks_the_least_busy():
    p = Policy("least_load", 3)
    assert p.choose(p.keys("anything"), {0: 3, 1: 1, 2: 2}).index == 1


def test_cache_aware_follows_the_prefix_until_load_overrules_it():
    p = Policy("cache_aware", 2, chunk_chars=16, balance_threshold=2)
    first = p.keys(SYSTEM + "Question one?")
    c = p.choose(first, {0: 0, 1: 0})
    assert c.reason == "spread"
    p.routed(c.index, first)
    home = c.index
    other = 1 - home
    second = p.keys(SYSTEM + "Question two, a different one?")
    c2 = p.choose(second, {home: 2, other: 0})  # busier by 2: still within the threshold
    assert (c2.index, c2.reason) == (home, "prefix") and c2.matched_chars == len(SYSTEM) // 16 * 16
    c3 = p.choose(second, {home: 3, other: 0})  # busier by 3: load wins
    assert (c3.index, c3.reason) == (other, "balance")
    # a prompt nobody holds goes round-robin among the replicas within the threshold of the least loaded
    fresh = p.keys("A completely unrelated prompt about gardening and soil. " * 3)
    spread = [p.choose(fresh, {0: 1, 1: 1}).index for _ in range(4)]
    assert sorted(spread) == [0, 0, 1, 1] and spread[0] != spread[1]
    assert {p.choose(fresh, {home: 5, other: 1}).index for _ in range(4)} == {other}  # 4 above: skipped
    p.forget(home)
    assert p.choose(second, {home: 0, other: 1}).reason == "spread"


def test_prefix_index_is_lru_bounded():
    idx = PrefixIndex(capacity=4)
    idx.insert([1, 2, 3])
    idx.insert([9, 8])        # 1 is evicted (least recently used)
    assert idx.match([1, 2]) == 0 and idx.match([9, 8]) == 2 and len(idx.keys) == 4
    idx.insert([2])           # touched: now newest
    idx.insert([7])
    assert 2 in idx.keys and 3 not in idx.keys


@pytest.mark.parametrize("bad", [dict(name="fastest"), dict(name="cache_aware", chunk_chars=0),
                                 dict(name="cache_aware", balance_threshold=-1)])
def test_bad_policy_settings_are_refused(bad):
    with pytest.raises(ValueError):
        Policy(num_replicas=2, **bad)


def test_routing_key_follows_the_rendered_order():
    chat = b'{"model": "m", "messages": [{"role": "system", "content": "Be brief."}, ' \
           b'{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}'
    text, model = routing_key(chat)
    assert model == "m" and text.index("Be brief.") < text.index("Hi")
    tools = b'{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}'
    assert routing_key(tools)[0].startswith('[{"type": "function"}]')
    assert routing_key(b'{"prompt": ["first", "second"]}')[0] == "first"
    assert routing_key(b'{"prompt": [1, 2, 3]}')[0] == "1,2,3"
    assert routing_key(b"not json") == ("", None) and routing_key(b"[1]") == ("", None)
    # Anthropic's messages (system apart) and Responses' input (instructions apart) key the same way
    anthropic = b'{"system": "Be brief.", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}'
    responses = b'{"instructions": "Be brief.", "input": "Hi"}'
    assert routing_key(anthropic)[0] == routing_key(responses)[0] == "<system>Be brief.\n<user>Hi"


@pytest.mark.parametrize("bad", [dict(replicas=[]), dict(replicas=["localhost:8000"]),
                                 dict(replicas=["http://a:1", "http://a:1/"]),
                                 dict(replicas=["http://a:1"], max_in_flight=0),
                                 dict(replicas=["http://a:1"], queue_timeout=0)])
def test_bad_router_config_is_refused(bad):
    with pytest.raises(ValueError):
        RouterConfig(**bad)


def test_cores_are_split_in_contiguous_shares():
    assert core_sets([0, 1, 2, 3, 4], 2) == [[0, 1, 2], [3, 4]]
    assert core_sets([0, 1], 2) == [[0], [1]]
    assert core_sets([5], 3) == [[5], [5], [5]]
    assert parse_cores("0-3,8, 10-11") == [0, 1, 2, 3, 8, 10, 11]
    for bad in ("", "a-b", "-1", "3-x"):
        with pytest.raises(ValueError):
            parse_cores(bad)


def test_replica_argv_keeps_every_serve_flag_but_the_parents():
    parser = build_parser()
    argv = ["serve", "--data-parallel-size", "2", "--port", "9000", "--api-key", "secret", "--threads", "4",
            "--served-model-name", "a", "--served-model-name", "b", "--max-num-seqs", "7", "--no-enable-prefix-caching",
            "--metrics-public", "--tool-call-parser", "hermes", "--request-timeout", "12.5"]
    args = parser.parse_args(argv)
    child = replica_argv(args.parser, args)
    assert "--port" not in child and "--api-key" not in child and "--threads" not in child
    assert "--data-parallel-size" not in child and "secret" not in child
    again = parser.parse_args(["serve", *child])
    for name in ("served_model_names", "max_num_seqs", "enable_prefix_caching", "metrics_public", "tool_call_parser",
                 "request_timeout"):
        assert getattr(again, name) == getattr(args, name), name
    assert again.port == 8000 and again.data_parallel_size == 1


def test_replica_metrics_are_relabelled_and_merged():
    text_a = "# HELP tokenmill:num_requests_running r\n# TYPE tokenmill:num_requests_running gauge\n" \
             'tokenmill:num_requests_running{model_name="m"} 2.0\n'
    text_b = text_a.replace("2.0", "5.0")
    m = RouterMetrics(["http://a", "http://b"], "cache_aware")
    out = m.render_replicas({"http://a": text_a, "http://b": text_b, "http://c": "<html>not metrics"}).decode()
    fams = {f.name: f for f in text_string_to_metric_families(out)}
    running = {s.labels["replica"]: s.value for s in fams["tokenmill:num_requests_running"].samples}
    assert running == {"http://a": 2.0, "http://b": 5.0} and set(fams) == {"tokenmill:num_requests_running"}
    own = {f.name for f in text_string_to_metric_families(m.render().decode())}
    assert "tokenmill:router_routing_decisions" in own and "tokenmill:router_replica_healthy" in own
