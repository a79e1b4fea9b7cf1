"""Token-embedding statistics: TEV, isotropy I(W), mean cosine, per frequency group."""
