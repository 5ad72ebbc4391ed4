"""`loraplex bench gateway`: the API layer's overhead against an engine that answers instantly."""
