"""Results tables rebuilt from what experiment folders and results.json files hold: repair
rows and retrainings (:mod:`.repair`), what removals take out (:mod:`.removals`), rankings
(:mod:`.ranking`), select rows and selections (:mod:`.select`), merged and aggregated
select results (:mod:`.merge`). Behind ``prism-select experiment rows|merge|aggregate``."""
