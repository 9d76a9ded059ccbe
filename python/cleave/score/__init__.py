"""`cleave score`: batch scoring of a Parquet file with data-parallel dense work and
model-parallel tables, the ranks exchanging ids and pooled embeddings through a bounded-lag
alltoallv (docs/score.md). One file per concern: `collective` (the alltoallv, usable alone),
`input` (columns, reading, checks), `ranks` (process group, table owners, rank processes),
`pipeline` (one rank's loop), `output` (chunks, progress record, merge), `job` (a job from
checks to summary), `cli`."""
