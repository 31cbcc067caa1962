"""The analysis side: reading the inputs (`inputs`), one analysis of them under the
options asked (`run`), on local processes or a cluster (`parallel`; gputrace's own
processes without pandas: `nopandas`), and what lies beside the analyzers' results
(`extras`, `document_flops`)."""
