//! Building and running the server: bind, make the demo merchant, start the
//! sweeper, the webhook delivery worker and the periodic reconciliation,
//! serve until a shutdown signal.

use std::sync::Arc;

use anyhow::Context;
use chrono::{DateTime, Utc};
use sqlx::PgPool;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::app::AppState;
use crate::config::Config;
use crate::db::Database;
use crate::http;
use crate::merchants::{self, ApiKey};
use crate::processor::{HttpProcessor, LedgerClient, Processor};
use crate::reconcile::Reconciler;
use crate::reconcile::job::{self, ReconcileJob};
use crate::speed::admission::Admission;
use crate::speed::cache::Caches;
use crate::speed::front::Front;
use crate::speed::reads::Reads;
use crate::speed::wait::Waits;
use crate::telemetry::metrics;
use crate::webhooks::deliver::{DeliverySettings, Worker};
use oncepay_core::operation::engine::Engine;
use oncepay_core::sweeper::Sweeper;

/// A bound, ready server.
pub struct Application {
    listener: TcpListener,
    state: AppState,
    limits: http::server::Limits,
}

impl Application {
    /// Binds `BIND_ADDR:PORT` (port 0 picks a free one) and prepares the
    /// state. Migrations and the demo merchant are the caller's choice (see
    /// [`Application::prepare_database`]).
    /// The processor is the card gateway at `PROCESSOR_URL`, over HTTP.
    /// `database` is a pool, or a [`Database`] whose primary it follows.
    pub async fn build(config: Config, database: impl Into<Database>) -> anyhow::Result<Self> {
        let processor: Arc<dyn Processor> = Arc::new(http_processor(&config)?);
        Self::build_with_processor(config, database, processor).await
    }

    /// [`Application::build`] with another processor, such as a test double
    /// that fails on purpose.
    pub async fn build_with_processor(
        config: Config,
        database: impl Into<Database>,
        processor: Arc<dyn Processor>,
    ) -> anyhow::Result<Self> {
        let Database { pool, primary } = database.into();
        // Every connection is a descriptor: raise the limit where the system
        // allows, and keep the connection cap within what it is then.
        let open_files = http::server::raise_open_file_limit();
        let limits = http::server::Limits::new(&config, open_files);
        if limits.max_connections < config.server.max_connections {
            tracing::warn!(
                configured = config.server.max_connections,
                lowered_to = limits.max_connections,
                open_files,
                "HTTP_MAX_CONNECTIONS lowered to fit the open-file limit"
            );
        }
        let listener = TcpListener::bind((config.server.bind_addr, config.server.port))
            .await
            .with_context(|| {
                format!("binding {}:{}", config.server.bind_addr, config.server.port)
            })?;
        let waits = Waits::new(pool.clone(), config.keys.processing_timeout);
        let caches = Arc::new(Caches::new(config.keys.replay_cache_bytes));
        let rate_limits = Arc::new(crate::rate_limit::RateLimits::new(
            config.rate_limits.reads(),
            config.rate_limits.writes(),
        ));
        // Opening a client only checks the URL; each request connects.
        let redis = config
            .workshop
            .redis_url
            .as_deref()
            .map(redis::Client::open)
            .transpose()
            .context("REDIS_URL")?;
        let traces = match &config.workshop.trace_file {
            Some(path) => crate::workshop::trace::Traces::open(path).context("DEMO_TRACE_FILE")?,
            None => Default::default(),
        };
        let admission = Arc::new(Admission::new(
            config.database.queue_timeout,
            config.database.queue_overload_timeout,
        ));
        let processing_timeout = config.keys.processing_timeout;
        let reads = Reads::start(pool.clone(), admission.clone(), processing_timeout);
        let processor = crate::telemetry::metrics::MeteredProcessor::wrap(processor);
        let engine = Engine {
            pool: pool.clone(),
            processor: processor.clone(),
            timeouts: config.timeouts(),
            tasks: tokio_util::task::TaskTracker::new(),
            admission,
            waits: Arc::new(waits),
        };
        let front = Front {
            caches: caches.clone(),
            reads,
        };
        let state = AppState::new(crate::app::Services {
            pool,
            config: Arc::new(config),
            processor,
            metrics: crate::telemetry::metrics::handle(),
            engine,
            front,
            caches,
            rate_limits,
            primary,
            redis,
            traces: Arc::new(traces),
        });
        Ok(Application {
            listener,
            state,
            limits,
        })
    }

    /// Applies migrations and makes sure the demo merchant exists.
    pub async fn prepare_database(&self) -> anyhow::Result<()> {
        if self.state.config.workshop.demo_unsafe_endpoints {
            tracing::warn!(
                "DEMO_UNSAFE_ENDPOINTS=true: POST /demo/naive/charges, /demo/naive/refunds, \
                 /demo/redis/charges and the webhook receivers under /demo/receiver/ are served. \
                 They double-charge, over-refund and double-ship on purpose, for teaching; never \
                 enable them anywhere real"
            );
        }
        if self.state.config.workshop.fault_injection {
            tracing::warn!("FAULT_INJECTION=true: requests may crash this process on purpose");
        }
        if self.state.config.webhooks.allow_private {
            tracing::warn!(
                "WEBHOOK_ALLOW_PRIVATE=true: webhook endpoints may point at loopback, private \
                 and link-local addresses, this host's and its network's services included; \
                 only for a receiver beside the service"
            );
        }
        crate::db::migrate(&self.state.pool).await?;
        if let Some(key) = &self.state.config.workshop.demo_api_key {
            let key = ApiKey::parse(key).context("DEMO_API_KEY")?;
            match merchants::ensure(&self.state.pool, "demo", &key).await? {
                merchants::Ensured::InUse(merchant) => {
                    tracing::info!(merchant = %merchant.id, name = %merchant.name, "demo merchant ready");
                }
                merchants::Ensured::RolledAway {
                    merchant,
                    works_until,
                } => demo_key_rolled_away(&merchant, works_until),
            }
        }
        Ok(())
    }

    /// The port actually bound.
    pub fn port(&self) -> u16 {
        self.listener
            .local_addr()
            .map(|a| a.port())
            .unwrap_or_default()
    }

    /// Serves, with the sweeper beside it, until `shutdown` resolves; then
    /// stops the sweeper and lets requests in flight finish.
    pub async fn run_until_stopped(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let config = self.state.config.clone();
        let tasks = self.state.engine.tasks.clone();
        let pool = self.state.pool.clone();
        // One stop signal for every task beside the server, given when
        // `shutdown` resolves.
        let stop = CancellationToken::new();
        let sweeper = Sweeper::new(
            self.state.pool.clone(),
            self.state.processor.clone(),
            config.sweep_settings(),
        );
        let sweeper =
            tokio::spawn(sweeper.run(config.keys.sweep_interval, stop.clone().cancelled_owned()));
        let worker = Worker::new(
            self.state.pool.clone(),
            DeliverySettings::from_config(&config),
        )?;
        let worker = tokio::spawn(worker.run(stop.clone().cancelled_owned()));
        // The periodic reconciliation, on one instance at a time.
        let reconciling = match (config.reconcile.enabled, config.processor.url.is_some()) {
            (true, true) => {
                job::describe_metrics();
                let reconciler = reconciler(
                    &config,
                    self.state.pool.clone(),
                    self.state.processor.clone(),
                )?;
                let job = ReconcileJob::new(
                    self.state.pool.clone(),
                    reconciler,
                    config.reconcile.interval,
                    config.reconcile.window,
                );
                Some(tokio::spawn(job.run(stop.clone().cancelled_owned())))
            }
            (true, false) => {
                tracing::warn!("no PROCESSOR_URL: the periodic reconciliation does not run");
                None
            }
            (false, _) => None,
        };
        // The relay of events to the broker, on one instance at a time.
        if config.broker.relay_enabled && config.broker.nats_url.is_some() {
            let relay =
                crate::broker::relay::run(pool.clone(), config.broker.clone(), stop.clone());
            tokio::spawn(relay);
        }
        tokio::spawn(metrics::upkeep(
            self.state.metrics.clone(),
            stop.clone().cancelled_owned(),
        ));
        tokio::spawn(crate::rate_limit::upkeep(
            self.state.rate_limits.clone(),
            stop.clone().cancelled_owned(),
        ));
        tracing::info!(addr = %self.listener.local_addr()?, "oncepay listening");
        tracing::info!(
            max_connections = self.limits.max_connections,
            header_read_timeout = ?self.limits.header_read_timeout,
            keep_alive_timeout = ?self.limits.keep_alive_timeout,
            "connection cap and timeouts"
        );
        let stopping = stop.clone();
        let server = http::server::serve(
            self.listener,
            http::router(self.state),
            self.limits,
            async move {
                shutdown.await;
                tracing::info!("shutting down: no new connections; finishing requests in flight");
                stop.cancel();
            },
        );
        // Serve until the signal, then give requests in flight (and the work
        // they handed to their own tasks) SHUTDOWN_GRACE to finish.
        // One deadline, SHUTDOWN_GRACE after the signal, bounds everything
        // that follows: open connections, the work they handed to tasks, the
        // sweeper's current pass, and closing the pool.
        let grace_period = config.server.shutdown_grace;
        let (deadline_tx, deadline_rx) = tokio::sync::oneshot::channel();
        let grace = async move {
            stopping.cancelled().await;
            let deadline = tokio::time::Instant::now() + grace_period;
            let _ = deadline_tx.send(deadline);
            tokio::time::sleep_until(deadline).await;
        };
        tokio::select! {
            () = server => {}
            _ = grace => tracing::warn!("shutdown grace over; dropping open connections"),
        }
        let deadline = deadline_rx
            .await
            .unwrap_or_else(|_| tokio::time::Instant::now() + grace_period);
        tasks.close();
        if tokio::time::timeout_at(deadline, tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                unfinished = tasks.len(),
                "shutdown grace over with work in flight; the sweeper will settle it"
            );
        }
        // The sweeper stops between passes; a pass cut short by the deadline
        // is safe (each step is its own transaction, and a leased row is
        // simply taken again after PROCESSING_TIMEOUT).
        let sweeper_abort = sweeper.abort_handle();
        if tokio::time::timeout_at(deadline, sweeper).await.is_err() {
            sweeper_abort.abort();
            tracing::warn!("shutdown grace over during a sweep pass; stopped it");
        }
        // Likewise the delivery worker: an attempt cut short is unrecorded,
        // and its delivery is due again once its lease runs out.
        let worker_abort = worker.abort_handle();
        if tokio::time::timeout_at(deadline, worker).await.is_err() {
            worker_abort.abort();
            tracing::warn!("shutdown grace over during webhook deliveries; stopped them");
        }
        // A reconciliation cut short records nothing and moved nothing.
        if let Some(reconciling) = reconciling {
            let abort = reconciling.abort_handle();
            if tokio::time::timeout_at(deadline, reconciling)
                .await
                .is_err()
            {
                abort.abort();
                tracing::warn!("shutdown grace over during a reconciliation; stopped it");
            }
        }
        let _ = tokio::time::timeout_at(deadline, pool.close()).await;
        tracing::info!("stopped");
        Ok(())
    }
}

/// The card gateway at `PROCESSOR_URL`, over HTTP, each call within
/// `PROCESSING_TIMEOUT` (the time a request's key is its own).
pub fn http_processor(config: &Config) -> anyhow::Result<HttpProcessor> {
    HttpProcessor::new(config.processor_settings()?)
}

/// A reconciler of `pool`'s records with the ledger of the gateway at
/// `PROCESSOR_URL`, refunding (with `--fix`) through `processor`.
pub fn reconciler(
    config: &Config,
    pool: PgPool,
    processor: Arc<dyn Processor>,
) -> anyhow::Result<Reconciler> {
    let ledger = LedgerClient::new(&config.processor_settings()?)?;
    Ok(Reconciler::new(
        pool,
        ledger,
        processor,
        config.keys.processing_timeout,
    ))
}

/// Resolves on Ctrl-C or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
    tracing::info!("shutting down");
}

/// Says that `DEMO_API_KEY` is a key its merchant rolled away. The start goes
/// on: the merchant and its key in use are as they should be, only this
/// setting is stale, and a fleet restarting with it must keep serving. No
/// merchant is made and the key is not revived: it works until
/// `works_until` if it is the merchant's previous key, else not at all.
fn demo_key_rolled_away(merchant: &merchants::Merchant, works_until: Option<DateTime<Utc>>) {
    tracing::warn!(
        merchant = %merchant.id,
        name = %merchant.name,
        works_until = works_until.map(|at| at.to_rfc3339()).as_deref().unwrap_or("expired"),
        "DEMO_API_KEY is a key this merchant rolled away: no merchant is made and the key is not \
         revived (it works until works_until, then not at all); set DEMO_API_KEY to the \
         merchant's key in use, or unset it"
    );
}
