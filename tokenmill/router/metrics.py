"""The router's Prometheus metrics (prefix `tokenmill:router_`, at /metrics), and the replicas' own
metrics re-exported under a `replica` label (at /metrics/replicas), so a deployment that cannot
scrape its replicas directly still sees them. Two paths, not one: a Prometheus that scrapes both the
replicas and several routers would otherwise count every replica series once per router."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0,
            80.0, 160.0)


class RouterMetrics:
    def __init__(self, replicas: list[str], policy: str) -> None:
        self.registry = r = CollectorRegistry()
        p = "tokenmill:router_"
        self.requests = Counter(p + "requests", "Requests answered, by replica and HTTP status",
                                ["replica", "status"], registry=r)
        self.ttfb = Histogram(p + "time_to_first_byte_seconds", "Arrival at the router to the first response byte "
                              "relayed", ["replica"], buckets=_BUCKETS, registry=r)
        self.duration = Histogram(p + "request_duration_seconds", "Arrival at the router to the end of the response",
                                  ["replica"], buckets=_BUCKETS, registry=r)
        self.decisions = Counter(p + "routing_decisions", "Routing decisions by policy and reason "
                                 "(prefix: sent where its prefix is; balance: a prefix match overruled by load; "
                                 "spread: no match, next in rotation; load: least loaded; round_robin)", ["policy", "reason"], registry=r)
        self.matched_chars = Counter(p + "prefix_matched_chars", "Prompt characters routed to a replica believed to "
                                     "hold them (cache_aware)", registry=r)
        self.query_chars = Counter(p + "prefix_query_chars", "Prompt characters of requests routed by cache_aware",
                                   registry=r)
        self.retries = Counter(p + "retries", "Requests sent again to another replica before their first byte",
                               ["reason"], registry=r)
        self.rejected = Counter(p + "rejected", "Requests answered 503 by the router itself", ["reason"], registry=r)
        self.ejections = Counter(p + "ejections", "Times a replica was taken out of rotation", ["replica"], registry=r)
        self.healthy = Gauge(p + "replica_healthy", "1 if the replica is in rotation", ["replica"], registry=r)
        self.in_flight = Gauge(p + "replica_in_flight", "Requests in flight on the replica through this router",
                               ["replica"], registry=r)
        self.queued = Gauge(p + "queue_length", "Requests waiting for a replica slot", registry=r)
        self._up: dict[str, bool] = {}
        for url in replicas:
            self.healthy.labels(replica=url).set(0)
            self.in_flight.labels(replica=url).set(0)
        for reason in ("prefix", "balance", "spread", "load", "round_robin"):
            self.decisions.labels(policy=policy, reason=reason)

    def replica_changed(self, replica) -> None:
        if self._up.get(replica.url) and not replica.healthy:
            self.ejections.labels(replica=replica.url).inc()
        self._up[replica.url] = replica.healthy
        self.healthy.labels(replica=replica.url).set(1 if replica.healthy else 0)
        self.in_flight.labels(replica=replica.url).set(replica.in_flight)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    @staticmethod
    def render_replicas(replica_texts: dict[str, str]) -> bytes:
        """Every replica family merged with a `replica` label."""
        merged = CollectorRegistry()
        merged.register(_Relabelled(replica_texts))
        return generate_latest(merged)


class _Relabelled:
    """A one-shot collector over scraped exposition texts: one family per name, each sample
    labelled with the replica it came from (a family must appear once in an exposition)."""

    def __init__(self, texts: dict[str, str]) -> None:
        self.texts = texts

    def collect(self):
        families: dict[str, Metric] = {}
        for url, text in self.texts.items():
            try:
                parsed = list(text_string_to_metric_families(text))
            except ValueError:
                continue  # not Prometheus text (a peer server without /metrics): nothing to add
            for fam in parsed:
                out = families.setdefault(fam.name, Metric(fam.name, fam.documentation, fam.type, fam.unit))
                if out.type != fam.type:
                    continue
                for s in fam.samples:
                    out.samples.append(s._replace(labels={**s.labels, "replica": url}))
        yield from families.values()
