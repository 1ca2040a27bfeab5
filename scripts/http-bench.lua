-- wrk script for dedupd's HTTP ingest: POST /v1/subscribers/bench/messages with an
-- Idempotency-Key per request. A fraction of requests (args[1], default 0.1) retries an
-- earlier key of the same wrk thread with the same payload, so the server replays it.
-- args[2] prefixes keys so runs against one data directory do not collide.
-- Fixed seeds: the same arguments give the same key sequence per thread.

local threads_made = 0

function setup(thread)
  thread:set("tid", threads_made)
  threads_made = threads_made + 1
end

function init(args)
  n = 0
  retry_rate = tonumber(args[1] or "0.1")
  prefix = args[2] or "run"
  math.randomseed(42 + tid)
  headers = { ["Content-Type"] = "application/json" }
end

function request()
  local k
  if n > 0 and math.random() < retry_rate then
    k = math.random(0, n - 1)
  else
    k = n
    n = n + 1
  end
  local key = prefix .. "-t" .. tid .. "-" .. k
  headers["Idempotency-Key"] = key
  local body = '{"order_id":"' .. key .. '","amount":' .. (k % 1000) .. ',"currency":"EUR"}'
  return wrk.format("POST", "/v1/subscribers/bench/messages", headers, body)
end
