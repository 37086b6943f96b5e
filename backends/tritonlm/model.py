"""Triton entry point of the `tritonlm` Python-based backend.

A model's config.pbtxt says `backend: "tritonlm"` and names its task in
`parameters { key: "task" ... }`; this file only picks the handler for that task.
All logic lives in the importable `tritonlm` package.
"""

import json

# The tritonlm package must be installed in the Python the stub runs (`make setup`,
# `pip install .` in the container): tritonserver starts the first python on PATH.
from tritonlm.glue import make_handler
from tritonlm.glue.drain import watch_drain


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.handler = make_handler(config, args)
        # tritonlm serve's drain deadline: streams still running then end with finish_reason
        # "cancelled" and their final response (tritonlm/glue/drain.py)
        self.drain = watch_drain(self.handler)

    def execute(self, requests):
        return self.handler.execute(requests)

    def finalize(self):
        drain = getattr(self, "drain", None)
        if drain is not None:
            drain.close()
        self.handler.finalize()
