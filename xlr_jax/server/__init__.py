"""`xlr serve`: an OpenAI-compatible HTTP server over one loaded `Model`.

protocol.py   request/response models (what /openapi.json shows) and the error shape
messages.py   chat messages -> what the chat template renders (roles, parts, tools)
tool_calls.py the Hermes-style tool block and the tool-call parser (whole and streamed)
metrics.py    Prometheus metrics (one registry per app)
request_log.py one JSON line per request, written by a background thread
app.py        the routes, auth and body-size middleware, and `serve` (uvicorn + drain)

The entry points are `xlr_jax.server.app.create_app(model, ...)` and `serve(...)`;
only app.py and protocol.py import FastAPI (the CLI imports them for `xlr serve`).
"""
