"""Executes a SchedulerOutput on the device: inputs, one forward pass, sampling."""
