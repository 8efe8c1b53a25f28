"""The trajectory database in a browser (Starlette + Jinja2 + vendored uPlot); `tools/monitor.py`
serves it. Lives outside `cua_jax`, which never imports an HTTP server."""
