"""Layout search: enumerate layouts, screen memory, estimate step time from per-layer slice costs."""
