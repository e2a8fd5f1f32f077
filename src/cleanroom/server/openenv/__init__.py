"""OpenEnv's environment protocol on ``cleanroom serve``: Gym envs as OpenEnv environments.

``cleanroom serve --openenv NAME=ENV@TEMPLATE`` serves the Gymnasium env ``ENV`` (an id or
``module:Class``, made inside VMs of the template ``TEMPLATE``) under ``/openenv/NAME``, with the
wire of ``openenv-core`` (``HTTPEnvServer``): ``POST /reset``, ``POST /step``, ``GET /state``,
``/health``, ``/schema``, ``/metadata``, and the WebSocket session ``/ws`` that OpenEnv's
``EnvClient`` speaks. Each WebSocket session is one ``CleanroomEnv`` (a Gym run of the ledger):
every reset a fresh VM, every episode a durable record, the VM destroyed and confirmed absent
when the episode ends, the client goes or the server stops. HTTP ``/reset`` and ``/step`` are
stateless, as OpenEnv's are: each is a one-episode run of its own.

- ``spec``: ``--openenv`` parsed (``OpenEnvSpec``);
- ``gymjson``: Gymnasium values and spaces as JSON and JSON schema, actions from JSON;
- ``hub``: the sessions, their limits and counters, shutdown;
- ``routes``: the HTTP and WebSocket endpoints (mounted by ``serving``).

Nothing here imports ``openenv-core``: the wire is matched to it, and the tests check it with the
real client (``tests/server/test_openenv.py``).
"""
