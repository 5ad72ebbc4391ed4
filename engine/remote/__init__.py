"""Scale-out: engines in worker processes, reached by gateways over an internal HTTP API.

- `protocol`: the wire format (JSON bodies; generation streams as newline-delimited JSON).
- `worker_app`: a worker's internal API around one engine, authenticated by a shared token.
- `heartbeat`: workers announce themselves in Redis; gateways read who is alive.
- `routing`: which worker serves a request (pure functions).
- `workers`: a gateway's view of the workers (heartbeats, rotation, in-flight counts).
- `client`: `RemoteEngine`, the `EngineClient` a gateway serves its API with.

NOTE: this package is a transport around the engine; the engine itself (core, scheduler,
runner) never imports it. Adapter files are not shipped over the wire: a worker reads them
from the shared adapter store, `<LORAPLEX_DATA_DIR>/adapters/<sha256>/`, so gateways and
workers must share that directory (one machine, or one shared volume).
"""
