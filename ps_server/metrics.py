"""Prometheus metrics of a running PS (`thc ps --metrics HOST:PORT`).

The exposition is prometheus_client's: a custom collector reads every shard's
`PSServer.snapshot()` at each scrape, so the numbers are the PS's own counters (nothing is
counted twice) and a job's series exist exactly while the job runs — they are gone from the
first scrape after it ends, and the label set never grows with the jobs a PS has served.

Families (every one labelled `shard`, the shard's index in this process):

* `thc_ps_*`: the PS's lifetime totals — every job so far, the running ones included, and
  the datagrams no job received (what `thc ps` prints as stats lines);
* `thc_job_*`: the same per running job, labelled `job_name` (the name its workers gave:
  one name, one job; not Prometheus' reserved `job` label, which names the scrape target);
* `thc_ps_io_*` / `thc_job_io_*`: the C engine's socket counters (how the datagrams were
  batched: GRO receives, GSO sends).

`/healthz` answers 200 ("ok", or "draining" while the PS drains) while every shard's data
and control threads run, 503 otherwise.  The HTTP server is the standard library's WSGI
server with a thread per request, so a slow or malformed request never holds the PS.
"""
from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector, CollectorRegistry

#: Data-plane counters of an engine (ps_server/reference.py COUNTERS): metric name, help.
DATA = {
    "packets_in": ("packets_in", "datagrams received"),
    "bytes_in": ("bytes_in", "bytes of datagrams received"),
    "packets_out": ("packets_out", "datagrams sent (results, straggler notices)"),
    "bytes_out": ("bytes_out", "bytes of datagrams sent"),
    "rounds_completed": ("rounds_completed", "slot rounds whose result went out"),
    "partial_rounds": ("partial_rounds", "slot rounds that went out with fewer than n contributors (quorum)"),
    "results_resent": ("results_resent", "retransmissions answered with a kept result"),
    "stragglers_notified": ("stragglers_notified", "STRAGGLER notices sent to late workers"),
}
#: Control counters: the PS's lifetime ones (PSServer.stats) and, those in JOB, a job's own.
CONTROL = {
    "registrations": ("registrations", "registrations accepted"),
    "rejoins": ("rejoins", "registrations that took over a rank that had left or died"),
    "leases_expired": ("leases_expired", "ranks that lost their lease"),
    "stall_s_excused": ("stall_seconds_excused", "seconds the PS stalled or was busy, excused from every lease"),
    "jobs_started": ("jobs_started", "jobs admitted"),
    "jobs_ended": ("jobs_ended", "jobs ended"),
    "registrations_queued": ("registrations_queued", "registrations answered `queued` (no room yet)"),
    "registrations_refused": ("registrations_refused", "registrations refused"),
    "control_errors": ("control_errors", "control requests answered with an error"),
    "engine_errors": ("engine_errors", "datagrams whose handling failed in a Python engine (logged; the data plane goes on)"),
}
GAUGES = {
    "jobs_running": ("jobs_running", "jobs running now"),
    "jobs_queued": ("jobs_queued", "jobs waiting for slots (the admission queue's length)"),
}
IO = {
    "rx_messages": "receive calls' messages (one GRO buffer each)",
    "rx_coalesced": "received messages that held several datagrams (GRO)",
    "rx_datagrams": "datagrams received",
    "tx_messages": "messages sent",
    "tx_gso_messages": "messages sent as GSO runs",
    "tx_datagrams": "datagrams sent",
    "gso_fallbacks": "GSO sends the kernel refused, sent again one datagram a message",
}


class PSCollector(Collector):
    """Reads the shards' snapshots at each scrape (prometheus_client's custom collector)."""

    def __init__(self, servers: list):
        self.servers = servers          # the caller's list: shards started later are read too

    def collect(self):
        shots = [s.snapshot() for s in self.servers]
        fams = {}

        def family(prefix: str, key: str, name: str, doc: str, labels: tuple, kind=CounterMetricFamily):
            if (prefix, key) not in fams:
                fams[prefix, key] = kind(f"{prefix}_{name}", doc, labels=list(labels))
            return fams[prefix, key]

        for shard, shot in enumerate(shots):
            sh = str(shard)
            total = shot["stats"]
            for key, (name, doc) in {**DATA, **CONTROL}.items():
                family("thc_ps", key, name, doc + " (every job so far)", ("shard",)).add_metric([sh], total.get(key, 0))
            for key, (name, doc) in GAUGES.items():
                family("thc_ps", key, name, doc, ("shard",), GaugeMetricFamily).add_metric([sh], total.get(key, 0))
            drops = family("thc_ps", "drops", "drops", "datagrams dropped, by reason (docs/protocol.md §3)",
                           ("shard", "reason"))
            for reason, n in total["drops"].items():
                drops.add_metric([sh, reason], n)
            for key, doc in IO.items():
                family("thc_ps_io", key, key, doc + " (the C engine)", ("shard",)).add_metric([sh], shot["io"].get(key, 0))
            family("thc_ps", "draining", "draining", "1 while the PS drains (admits no new job)", ("shard",),
                   GaugeMetricFamily).add_metric([sh], int(shot["draining"]))
            for job in shot["jobs"]:
                labels = (sh, job["name"])
                for key, (name, doc) in DATA.items():
                    family("thc_job", key, name, doc, ("shard", "job_name")).add_metric(labels, job["stats"].get(key, 0))
                for key, n in job["control"].items():
                    name, doc = CONTROL[key]
                    family("thc_job", key, name, doc, ("shard", "job_name")).add_metric(labels, n)
                jdrops = family("thc_job", "drops", "drops", "the job's datagrams dropped, by reason",
                                ("shard", "job_name", "reason"))
                for reason, n in job["stats"]["drops"].items():
                    jdrops.add_metric([*labels, reason], n)
                for key, doc in IO.items():
                    if key in job["io"]:
                        family("thc_job_io", key, key, doc + " (the job's C engine)",
                               ("shard", "job_name")).add_metric(labels, job["io"][key])
                family("thc_job", "live_ranks", "live_ranks", "the job's live ranks", ("shard", "job_name"),
                       GaugeMetricFamily).add_metric(labels, job["live"])
                family("thc_job", "num_workers", "num_workers", "the job's n", ("shard", "job_name"),
                       GaugeMetricFamily).add_metric(labels, job["num_workers"])
        yield from fams.values()


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format, *args):      # noqa: A002 - the base class's signature
        pass


class MetricsServer:
    """HTTP on (host, port): `/metrics` (Prometheus' text format) and `/healthz`.  Binding
    happens here, so a port in use or an address that does not resolve raises OSError before
    anything else starts; `start` serves from a thread, `stop` ends it."""

    def __init__(self, servers: list, host: str, port: int):
        self.servers = servers          # the caller's list (the shards, appended as they start)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(PSCollector(self.servers))
        self._metrics = make_wsgi_app(self.registry)
        self.httpd = make_server(host, port, self._app, server_class=_Server, handler_class=_Quiet)
        self.address = self.httpd.server_address[:2]
        self._thread: threading.Thread | None = None

    def _app(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        if path == "/healthz":
            up = bool(self.servers) and all(s.serving() for s in self.servers)
            body = (b"draining\n" if any(s.draining for s in self.servers) else b"ok\n") if up else b"stopped\n"
            start_response("200 OK" if up else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [body]
        if path == "/metrics":
            return self._metrics(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"/metrics or /healthz\n"]

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        daemon=True, name="thc-metrics")
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join(timeout=5)
        self.httpd.server_close()
