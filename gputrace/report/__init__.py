"""Renderers: terminal (rich), JSON; exporters: Perfetto/Chrome JSON."""
