"""Serving a pipeline over its ranks: jobs, the rank protocol, the HTTP app.

The framework's half of a server. A model plugs in through a `ServeAdapter`
(`dtgen.serve.engine`): it validates a request's fields and runs one request on every
rank; everything else (queueing, progress, cancellation, the ranks' lockstep, routes,
metrics) lives here.
"""
