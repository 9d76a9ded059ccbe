"""Capacity simulation (docs/simulate.md): replay a trace of CN and HN instance arrivals and
departures on a cluster under monolithic and disaggregated deployment, measure fragmentation,
GPUs needed and capacity loaning; scaling signals from a load trace."""
