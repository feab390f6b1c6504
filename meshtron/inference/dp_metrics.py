"""Per-replica gauges of a data-parallel server's /metrics, labelled `replica` with the worker's
name, read from the coordinator's last stats when scraped (a replica that left disappears)."""

from __future__ import annotations

import weakref

from prometheus_client import CollectorRegistry, Gauge

__meshtron_api__ = "internal"  # plumbing, free to change (docs/api.md)

# (name, help, where in a replica's coordinator stats: top level or its engine's counters, key)
PER_REPLICA = (
    ("meshtron_replica_requests_in_flight", "Requests the coordinator placed on the replica, not yet answered",
     None, "in_flight"),
    ("meshtron_replica_outstanding_tokens", "The replica's routing load: prompt + new tokens still allowed",
     None, "outstanding_tokens"),
    ("meshtron_replica_requests_served", "Requests the replica answered since it registered", None, "served"),
    ("meshtron_replica_requests_running", "Requests in the replica's batch", "engine", "num_running"),
    ("meshtron_replica_requests_waiting", "Requests queued in the replica's engine", "engine", "num_waiting"),
    ("meshtron_replica_kv_blocks_free", "The replica's free KV-cache blocks", "engine", "num_free_blocks"),
)


class ReplicaGauges:
    def __init__(self, registry: CollectorRegistry):
        self.live = Gauge("meshtron_replicas_live", "Engine replicas registered with the coordinator",
                          registry=registry)
        self.gauges = [(Gauge(name, help_text, ["replica"], registry=registry), part, key)
                       for name, help_text, part, key in PER_REPLICA]

    def update(self, stats: dict) -> None:
        """`stats`: `ReplicaFront.stats()`."""
        self.live.set(stats.get("num_replicas", 0))
        for gauge, part, key in self.gauges:
            gauge.clear()
            for name, replica in stats["replicas"].items():
                values = replica.get(part, {}) if part else replica
                if key in values:
                    gauge.labels(name).set(values[key])


_GAUGES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def replica_gauges(registry: CollectorRegistry) -> ReplicaGauges:
    """The gauges of `registry` (one server's), made on first use."""
    if registry not in _GAUGES:
        _GAUGES[registry] = ReplicaGauges(registry)
    return _GAUGES[registry]
