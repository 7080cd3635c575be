"""What observes the product: metrics, status, the load tester; ``bench/`` is the repo's harness."""
