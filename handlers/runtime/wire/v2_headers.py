"""The HTTP headers of KServe v2's binary tensor extension: a body's JSON header length, and the
content type of a body that carries binary tensors after that header. Constants alone (load
generators import them without torch)."""

HEADER_LENGTH = "Inference-Header-Content-Length"
BINARY = "application/octet-stream"
