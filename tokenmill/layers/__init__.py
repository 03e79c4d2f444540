"""Model building blocks (torch, device-agnostic). They read per-step metadata from the
ForwardContext and never synchronise with the host."""
