//! Opening a shard: the format check, loading generations and filters, replaying logs of
//! unsealed generations, and deleting leftovers of interrupted sealing or merging. All of
//! it runs in one durable transaction before the shard accepts anything (G3).

use super::*;
use crate::ledger::backends::tracked::TrackedBackend;
use crate::ledger::OpenProgress;

struct Loaded {
    metas: Vec<(String, u64, GenMeta)>,
    tables: Vec<String>,
}

impl Shard {
    /// Opens or creates the shard file, checks its format, loads filters, replays logs and
    /// removes leftovers of interrupted sealing or merging. Nothing is accepted before this
    /// returns (G3).
    pub(crate) fn open(ctx: ShardContext) -> Result<Shard, LedgerError> {
        let path = ctx.path.clone();
        let err = |e: redb::Error| storage(&path, e);
        let mut builder = Database::builder();
        builder.set_cache_size(ctx.config.cache_mib.get() << 20);
        builder.set_check_integrity_on_open(ctx.config.verify_on_open);
        if let Some(observer) = ctx.observer.clone() {
            observer(OpenProgress::Opening {
                shard: ctx.index,
                of: ctx.count,
            });
            // redb scans the whole file (several times) to repair it: the long step after a
            // kill. It calls back at the start and after each scan.
            let shard = ctx.index;
            builder.set_repair_callback(move |session| {
                observer(OpenProgress::Repairing {
                    shard,
                    fraction: session.progress(),
                })
            });
        }
        // As `builder.create(path)` opens it, with the writes recorded during a backup.
        // Only the open that creates the data directory creates a shard file; later, a
        // missing file (or a symlink to a missing file) is refused, not created empty.
        let file = crate::ledger::private_file()
            .read(true)
            .write(true)
            .create(ctx.create)
            .truncate(false)
            .open(&ctx.path)
            .map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound if !ctx.create => {
                    LedgerError::MissingShard { path: path.clone() }
                }
                _ => storage(&path, redb::StorageError::Io(e)),
            })?;
        if !ctx.create {
            let len = file
                .metadata()
                .map_err(|e| storage(&path, redb::StorageError::Io(e)))?
                .len();
            if len == 0 {
                return Err(LedgerError::EmptyShard {
                    path,
                    detail: "is empty (0 bytes)".into(),
                });
            }
        }
        let writes = ctx.writes.clone();
        let db = match &ctx.fault {
            None => {
                let backend =
                    redb::backends::FileBackend::new(file).map_err(|e| storage(&path, e))?;
                builder.create_with_backend(TrackedBackend::new(backend, writes))
            }
            Some(budget) => {
                let backend =
                    crate::ledger::backends::fault::FaultyBackend::new(file, budget.clone())
                        .map_err(|e| storage(&path, e))?;
                builder.create_with_backend(TrackedBackend::new(backend, writes))
            }
        }
        .map_err(|e| storage(&path, e))?;
        let (built_tx, built_rx) = unbounded();
        let mut shard = Shard {
            db: Arc::new(db),
            subs: Vec::new(),
            next_table_id: 1,
            next_quarantine_seq: 1,
            built_tx,
            built_rx,
            last_expiry_check_ms: 0,
            batch: Vec::new(),
            quarantine_rows: Vec::new(),
            failed: None,
            spare_maps: Vec::new(),
            map_requested: false,
            spare_bytes: 0,
            trims_deferred: false,

            undurable: false,
            retired_logs: Default::default(),
            retired_claims: Default::default(),
            retries: Default::default(),
            retry_order: 0,
            shares: share::Shares::new(),
            dead_rows: Vec::new(),
            settled: Vec::new(),
            next_outbox_seq: 1,
            outbox_warned: 0,
            next_dead_seq: 1,
            handler_msg: HandlerMessage::default(),
            last_effects: None,
            probing: HashMap::new(),
            held_unprobed: Vec::new(),
            next_group: 0,
            next_state_turn: 0,
            ctx,
        };
        let txn = shard.durable_txn()?;
        let loaded = shard.check_meta_and_load(&txn)?;
        state::upgrade_old_tables(&txn, &loaded.tables).map_err(|e| shard.err(e))?;
        shard.recover(&txn, loaded)?;
        txn.commit().map_err(|e| err(e.into()))?;
        let index = shard.ctx.index;
        shard.observe(|| OpenProgress::Opened { shard: index });
        shard.ctx.observer = None;
        Ok(shard)
    }

    /// Tells the open's observer, if any, what the open does now (built only if there is
    /// one).
    fn observe(&self, step: impl FnOnce() -> OpenProgress) {
        if let Some(observer) = &self.ctx.observer {
            observer(step());
        }
    }

    fn check_meta_and_load(&mut self, txn: &WriteTransaction) -> Result<Loaded, LedgerError> {
        let upgrade_from = self.check_meta(txn)?;
        let metas = self.load_generation_metas(txn)?;
        txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
        txn.open_table(tables::QUARANTINE)
            .map_err(|e| self.err(e))?;
        let tables: Vec<String> = txn
            .list_tables()
            .map_err(|e| self.err(e))?
            .map(|h| h.name().to_string())
            .collect();
        self.load_placements(txn, &metas, &tables, upgrade_from)?;
        Ok(Loaded { metas, tables })
    }

    /// Writes the meta of a new shard file, or checks an existing one and takes its
    /// counters. Returns the format an older file held (its meta now says this build's).
    fn check_meta(&mut self, txn: &WriteTransaction) -> Result<Option<u64>, LedgerError> {
        let mut meta = txn.open_table(tables::META).map_err(|e| self.err(e))?;
        let version = meta
            .get(tables::meta::FORMAT_VERSION)
            .map_err(|e| self.err(e))?
            .map(|v| v.value());
        match version {
            None if !self.ctx.create => {
                return Err(LedgerError::EmptyShard {
                    path: self.ctx.path.clone(),
                    detail: "holds no dedupd data (no format version)".into(),
                })
            }
            None => {
                let index = self.ctx.index as u64;
                let count = self.ctx.count as u64;
                for (k, v) in [
                    (tables::meta::FORMAT_VERSION, FORMAT_VERSION),
                    (tables::meta::SHARD_INDEX, index),
                    (tables::meta::SHARD_COUNT, count),
                    (tables::meta::NEXT_TABLE_ID, 1),
                    (tables::meta::NEXT_QUARANTINE_SEQ, 1),
                    (tables::meta::NEXT_OUTBOX_SEQ, 1),
                    (tables::meta::NEXT_DEAD_SEQ, 1),
                ] {
                    meta.insert(k, v).map_err(|e| self.err(e))?;
                }
            }
            Some(v) if v > FORMAT_VERSION => {
                return Err(LedgerError::NewerFormat {
                    path: self.ctx.path.clone(),
                    found: v,
                    supported: FORMAT_VERSION,
                })
            }
            Some(_) => self.read_meta(&meta)?,
        }
        let upgrade_from = version.filter(|v| *v < FORMAT_VERSION);
        if upgrade_from.is_some() {
            meta.insert(tables::meta::FORMAT_VERSION, FORMAT_VERSION)
                .map_err(|e| self.err(e))?;
        }
        Ok(upgrade_from)
    }

    /// Checks that an existing file is this shard and takes its counters.
    fn read_meta(&mut self, meta: &redb::Table<&'static str, u64>) -> Result<(), LedgerError> {
        let path = self.ctx.path.clone();
        let get = |k: &str| -> Result<u64, LedgerError> {
            meta.get(k)
                .map_err(|e| storage(&path, e))?
                .map(|v| v.value())
                .ok_or_else(|| LedgerError::Corrupt {
                    path: path.clone(),
                    detail: format!("meta key `{k}` is missing"),
                })
        };
        let index = get(tables::meta::SHARD_INDEX)?;
        let count = get(tables::meta::SHARD_COUNT)?;
        if index != self.ctx.index as u64 || count != self.ctx.count as u64 {
            return Err(self.corrupt(format!(
                "file says it is shard {index} of {count}, expected {} of {}",
                self.ctx.index, self.ctx.count
            )));
        }
        self.next_table_id = get(tables::meta::NEXT_TABLE_ID)?;
        self.next_quarantine_seq = get(tables::meta::NEXT_QUARANTINE_SEQ)?;
        self.next_outbox_seq = get(tables::meta::NEXT_OUTBOX_SEQ)?;
        self.next_dead_seq = get(tables::meta::NEXT_DEAD_SEQ)?;
        // Written since format 8; a directory of an older one has no mark yet.
        if let Some(t) = meta
            .get(tables::meta::ENGINE_TIME_MS)
            .map_err(|e| storage(&path, e))?
        {
            self.ctx
                .time_mark
                .fetch_max(t.value(), std::sync::atomic::Ordering::SeqCst);
        }
        Ok(())
    }

    /// Every generation's meta: `(subscriber, table id, meta)`.
    fn load_generation_metas(
        &self,
        txn: &WriteTransaction,
    ) -> Result<Vec<(String, u64, GenMeta)>, LedgerError> {
        let gens = txn
            .open_table(tables::GENERATIONS)
            .map_err(|e| self.err(e))?;
        let mut metas = Vec::new();
        for row in gens.iter().map_err(|e| self.err(e))? {
            let (k, v) = row.map_err(|e| self.err(e))?;
            let (sub, id) = k.value();
            let m = GenMeta::decode(v.value())
                .map_err(|d| self.corrupt(format!("generation {sub}/{id}: {d}")))?;
            metas.push((sub.to_string(), id, m));
        }
        Ok(metas)
    }

    /// Takes the placement masks this shard recorded into the registry. After an upgrade
    /// from format 1, first marks every subscriber with claims or handler state here as
    /// placed anywhere.
    fn load_placements(
        &self,
        txn: &WriteTransaction,
        metas: &[(String, u64, GenMeta)],
        table_names: &[String],
        upgrade_from: Option<u64>,
    ) -> Result<(), LedgerError> {
        let mut placements = txn
            .open_table(tables::PLACEMENTS)
            .map_err(|e| self.err(e))?;
        if let Some(from) = upgrade_from.filter(|v| *v < 2) {
            // Format 1 routed by the configured partition key: a subscriber's claims may
            // be on any shard, and its handler state is not scoped to entities.
            let mut names: std::collections::BTreeSet<&str> =
                metas.iter().map(|(sub, _, _)| sub.as_str()).collect();
            names.extend(
                table_names
                    .iter()
                    .filter_map(|t| tables::state_table_subscriber(t)),
            );
            for name in &names {
                placements
                    .insert(*name, placement::ANYWHERE)
                    .map_err(|e| self.err(e))?;
            }
            tracing::warn!(shard = self.ctx.index, from, to = FORMAT_VERSION, subscribers = names.len(),
                "upgraded the shard's format: its subscribers' claims are now looked up on every shard");
        }
        for row in placements.iter().map_err(|e| self.err(e))? {
            let (name, mask) = row.map_err(|e| self.err(e))?;
            let spec = self.ctx.registry.resolve(name.value(), true)?;
            spec.placements.fetch_or(mask.value(), Ordering::AcqRel);
        }
        txn.open_table(tables::KEY_SOURCES)
            .map_err(|e| self.err(e))?;
        Ok(())
    }

    /// Rebuilds in-memory state from the generations table and deletes leftovers.
    fn recover(&mut self, txn: &WriteTransaction, loaded: Loaded) -> Result<(), LedgerError> {
        let now = self.ctx.clock.now_ms();
        let mut keep_claims = std::collections::HashSet::new();
        let mut keep_logs = std::collections::HashSet::new();
        let mut by_sub: std::collections::BTreeMap<String, Vec<(u64, GenMeta)>> =
            Default::default();
        for (sub, id, m) in loaded.metas {
            by_sub.entry(sub).or_default().push((id, m));
        }
        for (name, mut gens) in by_sub {
            let spec = self.ctx.registry.resolve(&name, true)?;
            gens.sort_by_key(|(_, m)| m.order);
            let mut st = new_sub_state(&spec, &self.db).map_err(|e| self.err(e))?;
            st.claims.next_order = gens.last().map_or(1, |(_, m)| m.order + 1);
            // How long this shard's claims of the subscriber live, for `check_key_source`.
            let mut live_until = 0u64;
            let mut logs: Vec<(u64, GenMeta)> = Vec::new();
            for (id, m) in gens {
                match m.state {
                    GenState::Sealed => {
                        let legacy = tables::legacy_claims_name(&name, id);
                        if loaded.tables.contains(&legacy) {
                            self.upgrade_legacy_claims(txn, &name, id)?;
                        }
                        let filter = self.load_filter(txn, &name, id)?;
                        keep_claims.insert(tables::claims_name(&name, id));
                        live_until = live_until.max(m.max_expires_ms);
                        st.claims.sealed.push(SealedGen {
                            table_id: id,
                            order: m.order,
                            count: m.count,
                            max_expires_ms: m.max_expires_ms,
                            created_at_ms: m.created_at_ms,
                            filter: Arc::new(filter),
                        });
                    }
                    GenState::Active | GenState::Sealing => {
                        keep_logs.insert(tables::log_name(&name, id));
                        logs.push((id, m));
                    }
                }
            }
            if !st.claims.sealed.is_empty() {
                self.observe(|| OpenProgress::Loaded {
                    shard: self.ctx.index,
                    subscriber: name.clone(),
                    generations: st.claims.sealed.len(),
                });
            }
            // The newest log generation stays active; older ones are sealed again as one.
            if let Some((id, m)) = logs.pop() {
                let (map, rows, until) = self.replay_log(txn, &name, &[id])?;
                live_until = live_until.max(until);
                st.claims.active = Some(ActiveGen {
                    table_id: id,
                    order: m.order,
                    map,
                    next_row: rows,
                    created_at_ms: m.created_at_ms,
                });
            }
            if !logs.is_empty() {
                let ids: Vec<u64> = logs.iter().map(|(id, _)| *id).collect();
                let (map, _, until) = self.replay_log(txn, &name, &ids)?;
                live_until = live_until.max(until);
                let (last_id, last_meta) = logs[logs.len() - 1];
                let gen = SealingGen {
                    table_id: last_id,
                    order: last_meta.order,
                    created_at_ms: last_meta.created_at_ms,
                    map: Arc::new(map),
                    built: None,
                    pos: 0,
                    extra_logs: ids[..ids.len() - 1].to_vec(),
                };
                self.start_sealing(&mut st, gen, now);
                let mut gens_t = txn
                    .open_table(tables::GENERATIONS)
                    .map_err(|e| self.err(e))?;
                for (id, m) in &logs {
                    let sealing = GenMeta {
                        state: GenState::Sealing,
                        ..*m
                    };
                    gens_t
                        .insert((name.as_str(), *id), sealing.encode().as_slice())
                        .map_err(|e| self.err(e))?;
                }
            }
            // Directories of formats before 8 recorded no key source: nothing to compare.
            if let Some(key) = &st.placement.key_source_on_disk {
                spec.note_claims(key, live_until);
            }
            let idx = spec.id.0 as usize;
            if self.subs.len() <= idx {
                self.subs.resize_with(idx + 1, || None);
            }
            self.subs[idx] = Some(st);
        }
        for name in loaded.tables {
            // Format-5 tables of sealed generations were rewritten above; any left belonged
            // to an interrupted sealing or merging.
            let orphan = (name.starts_with(tables::CLAIMS_PREFIX) && !keep_claims.contains(&name))
                || (name.starts_with(tables::LOG_PREFIX) && !keep_logs.contains(&name))
                || name.starts_with(tables::LEGACY_CLAIMS_PREFIX);
            if orphan {
                tracing::info!(shard = self.ctx.index, table = %name, "removing leftover of interrupted sealing or merging");
                txn.delete_table(claims_def(&name))
                    .map_err(|e| self.err(e))?;
                // A merge records its output's filter one transaction before the finish.
                if let Some((sub, id)) = tables::claims_generation(&name) {
                    let mut filters = txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
                    filters.remove((sub, id)).map_err(|e| self.err(e))?;
                }
            }
        }
        Ok(())
    }

    /// Rewrites a format-5 sealed generation (one row per claim) as blocks under its new
    /// name, in the opening transaction; the old table is deleted with the other leftovers.
    fn upgrade_legacy_claims(
        &self,
        txn: &WriteTransaction,
        sub: &str,
        id: u64,
    ) -> Result<(), LedgerError> {
        let legacy = tables::legacy_claims_name(sub, id);
        let old = txn
            .open_table(tables::legacy_claims_def(&legacy))
            .map_err(|e| self.err(e))?;
        let name = tables::claims_name(sub, id);
        let mut t = txn.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
        let mut w = BlockWriter::default();
        let mut count = 0u64;
        for row in old.iter().map_err(|e| self.err(e))? {
            let (k, v) = row.map_err(|e| self.err(e))?;
            w.push(k.value(), &ClaimRecord::decode(&v.value()));
            count += 1;
            if w.is_full() {
                if let Some((key, block)) = w.take() {
                    t.insert(key, block.as_slice()).map_err(|e| self.err(e))?;
                }
            }
        }
        if let Some((key, block)) = w.take() {
            t.insert(key, block.as_slice()).map_err(|e| self.err(e))?;
        }
        tracing::info!(
            shard = self.ctx.index,
            subscriber = sub,
            generation = id,
            claims = count,
            "rewrote a sealed generation as claim blocks (format 6)"
        );
        Ok(())
    }

    fn load_filter(
        &self,
        txn: &WriteTransaction,
        sub: &str,
        id: u64,
    ) -> Result<GenFilter, LedgerError> {
        let mut filters = txn.open_table(tables::FILTERS).map_err(|e| self.err(e))?;
        let stored = filters
            .get((sub, id))
            .map_err(|e| self.err(e))?
            .map(|v| GenFilter::decode(v.value()));
        match stored {
            Some(Ok(f)) => Ok(f),
            other => {
                // A lost, unreadable or damaged (checksum) filter is rebuilt from the
                // sorted table itself.
                let problem = match other {
                    Some(Err(e)) => e.to_string(),
                    _ => "filter record missing".to_string(),
                };
                tracing::warn!(file = %self.ctx.path.display(), shard = self.ctx.index,
                    subscriber = sub, generation = id, %problem,
                    "damaged generation filter; rebuilding it from the generation's table");
                let name = tables::claims_name(sub, id);
                let t = txn.open_table(claims_def(&name)).map_err(|e| self.err(e))?;
                let (entries, _) = block::read_after(&t, None, usize::MAX)
                    .map_err(|e| block_error(&self.ctx.path, &name, e))?;
                let f = GenFilter::build(entries.into_iter().map(|e| e.0));
                filters
                    .insert((sub, id), f.encode().as_slice())
                    .map_err(|e| self.err(e))?;
                Ok(f)
            }
        }
    }

    /// Reads log tables in order into one map (later rows win). Returns the map and the
    /// row count of the last table.
    fn replay_log(
        &self,
        txn: &WriteTransaction,
        sub: &str,
        ids: &[u64],
    ) -> Result<(KeyMap, u64, u64), LedgerError> {
        let mut map = KeyMap::default();
        let mut rows = 0;
        let mut live_until = 0;
        let mut replayed = 0u64;
        let replaying = |rows| OpenProgress::Replaying {
            shard: self.ctx.index,
            subscriber: sub.to_string(),
            rows,
        };
        for id in ids {
            let name = tables::log_name(sub, *id);
            let t = txn.open_table(log_def(&name)).map_err(|e| self.err(e))?;
            rows = 0;
            for row in t.iter().map_err(|e| self.err(e))? {
                let (k, v) = row.map_err(|e| self.err(e))?;
                let entries = LogRow::decode(v.value())
                    .map_err(|d| self.corrupt(format!("log {name} row {}: {d}", k.value())))?;
                for (key, rec) in entries {
                    live_until = live_until.max(rec.expires_at_ms);
                    map.insert(key, rec);
                }
                rows = k.value() + 1;
                replayed += 1;
                if replayed.is_multiple_of(crate::ledger::REPLAY_EVERY) {
                    self.observe(|| replaying(replayed));
                }
            }
        }
        if !replayed.is_multiple_of(crate::ledger::REPLAY_EVERY) {
            self.observe(|| replaying(replayed));
        }
        Ok((map, rows, live_until))
    }
}

/// A subscriber's state on this shard, with the handler effects a crash or stop left in its
/// state log (see `state/`).
pub(super) fn new_sub_state(
    spec: &crate::ledger::Subscriber,
    db: &Database,
) -> Result<SubState, redb::Error> {
    let mut pending_log = Vec::new();
    LogRow::start(&mut pending_log);
    let kept = records::load(db, &spec.name)?;
    let mut records = kept.records;
    records.quarantined = kept.quarantined;
    records.dead_lettered = kept.dead_lettered;
    let mut st = SubState {
        id: spec.id,
        name: spec.name.clone(),
        settings_epoch: 0,
        claims: SubClaims::new(pending_log),
        records,
        handling: SubHandling::new(StateBuffer::load(db, &spec.name)?),
        placement: SubPlacement {
            probe: false,
            disk_mask: placement_mask(db, &spec.name)?,
            mask_pending: 0,
            key_source: Arc::from(""),
            key_source_on_disk: recorded_key_source(db, &spec.name)?,
            presence: None,
        },
        changelog: Default::default(),
    };
    apply_settings(&mut st, spec);
    Ok(st)
}

/// The placement bits this shard recorded for a subscriber.
fn placement_mask(db: &Database, subscriber: &str) -> Result<u8, redb::Error> {
    let txn = db.begin_read()?;
    let table = match txn.open_table(tables::PLACEMENTS) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(0),
        Err(e) => return Err(e.into()),
    };
    Ok(table.get(subscriber)?.map(|v| v.value()).unwrap_or(0))
}

/// The key source this shard recorded for a subscriber's claims.
fn recorded_key_source(db: &Database, subscriber: &str) -> Result<Option<Arc<str>>, redb::Error> {
    let txn = db.begin_read()?;
    let table = match txn.open_table(tables::KEY_SOURCES) {
        Ok(t) => t,
        Err(redb::TableError::TableDoesNotExist(_)) => return Ok(None),
        Err(e) => return Err(e.into()),
    };
    Ok(table.get(subscriber)?.map(|v| Arc::from(v.value())))
}

/// Takes a subscriber's current settings into its shard state (between batches).
pub(super) fn apply_settings(st: &mut SubState, spec: &crate::ledger::Subscriber) {
    st.settings_epoch = spec.settings_epoch();
    let settings = spec.settings();
    st.placement.key_source = Arc::from(crate::ledger::key_source_text(&settings.key));
    st.claims.ttl_ms = settings.ttl.as_millis() as u64;
    st.claims.sliding = settings.sliding_ttl;
    st.handling.max_attempts = settings.max_attempts.max(1);
    st.handling.retry_backoff = settings.retry_backoff;
    st.handling.max_backoff = settings.max_backoff;
    st.handling.breaker_threshold = settings.handler_breaker_failures;
    st.handling.breaker_cooldown_ms = settings.handler_breaker_cooldown.as_millis() as u64;
}
