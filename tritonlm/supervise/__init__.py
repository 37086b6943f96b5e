"""Self-healing for `tritonlm serve`: watch every model's processes, tell the probes and the
clients when one dies or hangs, and bring the model back (or give up and exit non-zero).

procs.py reads the process table, watch.py turns it into faults, health.py holds what the
probes, the metrics and the OpenAI frontend see, endpoint.py serves it over HTTP, and
recovery.py decides when to try again and when to stop trying.
"""
