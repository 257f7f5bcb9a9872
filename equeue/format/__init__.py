"""On-disk layouts, one module per layout. Nothing else declares a format constant."""
