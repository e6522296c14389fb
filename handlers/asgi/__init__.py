"""The second engine: the project's own ASGI server (uvicorn + Starlette) over the runtime, serving
the same archives as TorchServe with the same client-facing API (``routes.py``)."""
