package org.torchrecserve.plugin;

import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.Executors;
import java.util.concurrent.LinkedBlockingDeque;
import java.util.concurrent.ScheduledExecutorService;
import java.util.concurrent.TimeUnit;
import org.pytorch.serve.job.Job;
import org.pytorch.serve.util.messages.BaseModelRequest;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;
import org.pytorch.serve.wlm.ModelVersionedRefs;
import org.pytorch.serve.wlm.WorkerState;
import org.pytorch.serve.wlm.WorkerThread;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * The plugin's watchdog, every 100 ms over every registered model version:
 *
 * <ul>
 *   <li>gives each model an {@link AdmissionQueue} (models registered through our {@code /models}
 *       get theirs before their workers start; others, e.g. loaded at startup, on the next tick);
 *   <li>finds hung workers: one that has run the same inference batch for longer than the model's
 *       hang threshold ({@link AdmissionQueue#hangAfterNs}) has its batch answered with a 503
 *       saying so, and its process killed; TorchServe then restarts it;
 *   <li>tells the queue when the model has no ready worker, so that requests get a 503 naming the
 *       reason at once instead of waiting for a restart;
 *   <li>answers health ({@link #problems}) for {@code /ping}.
 * </ul>
 *
 * <p>Beside it, {@link StartPriority} starts new workers below serving's CPU priority.
 */
final class Guard {
    private static final Logger logger = LoggerFactory.getLogger(Guard.class);
    private static final long TICK_MS = 100;
    private static final long RETIRED_WATCH_NS = TimeUnit.SECONDS.toNanos(5);
    private static Guard instance;

    /** A worker running one batch since {@code sinceNs}. */
    private static final class Busy {
        final BaseModelRequest batch;
        final long sinceNs;
        boolean hung;

        Busy(BaseModelRequest batch, long sinceNs) {
            this.batch = batch;
            this.sinceNs = sinceNs;
        }
    }

    /** A worker the guard killed for not answering, until it serves again; ``detail`` says so. */
    private record Hang(int pid, long atNs, String detail) {}

    /** A model's replaced data queue, watched for a while for requests that still landed in it. */
    private record Retired(LinkedBlockingDeque<Job> old, AdmissionQueue replacement, long sinceNs) {}

    private final Map<WorkerThread, Busy> busy = new ConcurrentHashMap<>();
    private final Map<WorkerThread, Hang> hangs = new ConcurrentHashMap<>();
    private final List<Retired> retired = new ArrayList<>();

    private Guard() {}

    static synchronized Guard get() {
        if (instance == null) {
            instance = new Guard();
            ScheduledExecutorService timer =
                    Executors.newSingleThreadScheduledExecutor(
                            r -> {
                                Thread thread = new Thread(r, "torchrec-serve-guard");
                                thread.setDaemon(true);
                                return thread;
                            });
            timer.scheduleWithFixedDelay(instance::tickSafely, TICK_MS, TICK_MS, TimeUnit.MILLISECONDS);
            StartPriority.start();
        }
        return instance;
    }

    private void tickSafely() {
        try {
            tick();
        } catch (Throwable t) { // the watchdog must outlive anything one tick meets
            logger.error("torchrec-serve guard tick failed", t);
        }
    }

    private void tick() {
        if (ModelManager.getInstance() == null) {
            return; // TorchServe is still starting
        }
        Set<WorkerThread> seen = ConcurrentHashMap.newKeySet();
        for (Model model : allModels()) {
            AdmissionQueue queue = queue(model);
            List<WorkerThread> workers = ModelManager.getInstance().getWorkers(model.getModelVersionName());
            seen.addAll(workers);
            int ready = 0;
            for (WorkerThread worker : workers) {
                watch(worker, queue);
                ready += worker.getState() == WorkerState.WORKER_MODEL_LOADED && !hangs.containsKey(worker) ? 1 : 0;
            }
            queue.setReadyWorkers(ready);
            queue.setUnavailable(unavailable(model, queue));
        }
        busy.keySet().retainAll(seen);
        hangs.keySet().retainAll(seen);
        sweepRetired();
    }

    /** Why the model cannot serve now (no worker ready, one of them being restarted), or null. */
    String unavailable(Model model, AdmissionQueue queue) {
        List<WorkerThread> workers = ModelManager.getInstance().getWorkers(model.getModelVersionName());
        if (workers.isEmpty()) {
            return null; // TorchServe answers a model without workers itself
        }
        String restarting = null;
        for (WorkerThread worker : workers) {
            Hang hang = hangs.get(worker);
            if (hang != null && worker.getState() == WorkerState.WORKER_MODEL_LOADED && worker.getPid() != hang.pid()) {
                hangs.remove(worker); // restarted and serving again
                hang = null;
            }
            if (hang != null) {
                restarting = hang.detail();
            }
        }
        for (WorkerThread worker : workers) {
            if (!hangs.containsKey(worker) && worker.getState() == WorkerState.WORKER_MODEL_LOADED) {
                return null;
            }
        }
        String why = restarting != null ? restarting : "its workers are starting or stopping";
        return queue.label + " has no ready worker: " + why + "; retry shortly";
    }

    private void watch(WorkerThread worker, AdmissionQueue queue) {
        BaseModelRequest batch = Internals.runningBatch(worker);
        if (batch == null) {
            busy.remove(worker);
            return;
        }
        long now = System.nanoTime();
        Busy current = busy.get(worker);
        if (current == null || current.batch != batch) {
            busy.put(worker, new Busy(batch, now));
        } else if (!current.hung && now - current.sinceNs > queue.hangAfterNs()) {
            current.hung = true;
            onHang(worker, queue, now - current.sinceNs);
        }
    }

    private void onHang(WorkerThread worker, AdmissionQueue queue, long busyNs) {
        int pid = worker.getPid();
        String detail =
                String.format(
                        "worker %s (pid %d) stopped answering (no reply to a batch for %.1f s) and is being restarted",
                        worker.getWorkerId(), pid, busyNs / 1e9);
        logger.error("{}: {}", queue.label, detail);
        hangs.put(worker, new Hang(pid, System.nanoTime(), detail));
        for (Job job : Internals.takeRunningJobs(worker)) {
            AdmissionQueue.refuse(job, queue.label + ": " + detail + "; retry");
        }
        Process process = worker.getLifeCycle().getProcess();
        if (process != null) {
            process.destroyForcibly(); // SIGKILL: also ends a stopped process; TorchServe restarts it
        }
    }

    /** The model's admission queue, put in place of TorchServe's own queue the first time. */
    AdmissionQueue queue(Model model) {
        return queue(model, Map.of());
    }

    /**
     * ``overrides``: guard settings given to the register call, over the archive's. The watchdog's
     * tick may have put the model's queue in place between TorchServe's registration and this
     * call: the register call's settings then replace the defaults it was given.
     */
    synchronized AdmissionQueue queue(Model model, Map<String, String> overrides) {
        LinkedBlockingDeque<Job> current = Internals.dataQueue(model);
        if (current instanceof AdmissionQueue admission) {
            if (!overrides.isEmpty()) {
                admission.settings = GuardSettings.of(model, overrides);
                logger.info("{}: admission settings {}", admission.label, admission.settings);
            }
            return admission;
        }
        int capacity = current.size() + current.remainingCapacity();
        AdmissionQueue admission = new AdmissionQueue(model, capacity, GuardSettings.of(model, overrides));
        Internals.setDataQueue(model, admission);
        moveInference(current, admission);
        // A worker may be waiting for work on the old queue, holding the model's poll lock: a
        // describe call gets it back to its loop, where it takes the new queue.
        current.offer(new DescribeJob(model.getModelName(), model.getVersion()));
        retired.add(new Retired(current, admission, System.nanoTime()));
        logger.info("{}: admission control on (queue of {}, {})", admission.label, capacity, admission.settings);
        return admission;
    }

    private synchronized void sweepRetired() {
        long now = System.nanoTime();
        retired.removeIf(r -> now - r.sinceNs() > RETIRED_WATCH_NS);
        for (Retired r : retired) {
            moveInference(r.old(), r.replacement());
        }
    }

    /** Moves requests that were offered to a replaced queue (already accepted) into its successor. */
    private static void moveInference(LinkedBlockingDeque<Job> from, AdmissionQueue to) {
        for (Job job : from) {
            if (Internals.isInference(job.getCmd()) && from.remove(job)) {
                to.takeAccepted(job);
            }
        }
    }

    /** What keeps the server from being healthy: a worker not answering, a model short of ready workers. */
    List<String> problems() {
        List<String> problems = new ArrayList<>();
        if (ModelManager.getInstance() == null) {
            return List.of("TorchServe is starting");
        }
        long now = System.nanoTime();
        for (Model model : allModels()) {
            AdmissionQueue queue = queue(model);
            List<WorkerThread> workers = ModelManager.getInstance().getWorkers(model.getModelVersionName());
            int ready = 0;
            for (WorkerThread worker : workers) {
                Busy current = busy.get(worker);
                Hang hang = hangs.get(worker);
                if (hang != null) {
                    problems.add(queue.label + ": " + hang.detail());
                } else if (current != null && now - current.sinceNs > queue.hangAfterNs() / 2) {
                    problems.add(
                            String.format(
                                    "%s: worker %s has been running one batch for %.1f s",
                                    queue.label, worker.getWorkerId(), (now - current.sinceNs) / 1e9));
                } else if (worker.getState() == WorkerState.WORKER_MODEL_LOADED) {
                    ready++;
                }
            }
            if (ready < model.getMinWorkers()) {
                problems.add(String.format("%s: %d of %d workers ready", queue.label, ready, model.getMinWorkers()));
            }
        }
        return problems;
    }

    static List<Model> allModels() {
        List<Model> models = new ArrayList<>();
        for (Map.Entry<String, ModelVersionedRefs> entry : ModelManager.getInstance().getAllModels()) {
            for (Map.Entry<String, Model> version : entry.getValue().getAllVersions()) {
                models.add(version.getValue());
            }
        }
        return models;
    }

    static String label(Model model) {
        return "model " + model.getModelName() + " version " + model.getVersion();
    }
}
