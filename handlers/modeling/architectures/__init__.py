"""One module per architecture; ``handlers.modeling.registry`` finds them."""
