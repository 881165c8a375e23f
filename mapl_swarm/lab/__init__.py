"""Network lab: the compose topology in Linux network namespaces with kernel (tbf) shaping."""
