"""The analysis side: reading the inputs (`inputs`), one analysis of them under the
options asked (`run`), on local processes or a cluster (`parallel`), and what lies
beside the analyzers' results (`extras`, `document_flops`)."""
