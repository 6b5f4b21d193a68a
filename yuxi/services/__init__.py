"""Services: each public function is one unit of work (one transaction)."""
