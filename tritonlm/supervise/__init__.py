"""Self-healing for `tritonlm serve`: watch every model's processes, tell the probes and the
clients when one dies or hangs, and bring the model back (or give up and exit non-zero).

procs.py reads the process table, served.py asks tritonserver which models it serves (its
repository index) and how many processes each asks for, watch.py turns both into faults
and per-model views, health.py holds what the probes, the metrics and the OpenAI frontend
see, endpoint.py serves it over HTTP, and recovery.py decides when to try again and when to
stop trying.
"""
