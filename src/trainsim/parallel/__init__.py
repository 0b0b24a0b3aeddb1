"""The parallel layout and the pipeline schedules, without torch: process groups of a rank, the order of its
forward and backward passes, and how layers split over stages. Every layer above reads them."""
