"""Backends that execute plans: ``sim`` (discrete-event simulator) and, later, ``ray`` (real)."""
