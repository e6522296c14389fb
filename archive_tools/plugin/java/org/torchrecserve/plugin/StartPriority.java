package org.torchrecserve.plugin;

import java.io.IOException;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.List;
import java.util.Map;
import java.util.Set;
import java.util.concurrent.ConcurrentHashMap;
import java.util.concurrent.Executors;
import java.util.concurrent.TimeUnit;
import java.util.stream.Stream;
import org.pytorch.serve.wlm.Model;
import org.pytorch.serve.wlm.ModelManager;
import org.pytorch.serve.wlm.WorkerState;
import org.pytorch.serve.wlm.WorkerThread;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

/**
 * New workers start below serving's CPU priority. A worker process that has not loaded its model
 * yet (Python starting, torch's import, the archive's load: seconds of CPU) runs every thread at
 * nice {@value #START_NICE}; once TorchServe marks it loaded, every thread gets its first nice
 * back. On a small machine a version registering, or a worker scaling up or restarting, then takes
 * the CPU that serving leaves, not serving's own.
 *
 * <p>Any process may lower its priority; raising it back needs CAP_SYS_NICE or an RLIMIT_NICE of 20
 * and more. Without either, workers start at normal priority (never stuck low) and the log says so
 * once. The workers' threads are listed in /proc (Linux only: elsewhere the log says so too) and
 * reniced with {@code renice}.
 */
final class StartPriority {
    static final int START_NICE = 10;
    private static final Logger logger = LoggerFactory.getLogger(StartPriority.class);
    private static final long TICK_MS = 20;
    private static final int CAP_SYS_NICE = 23;
    private static StartPriority instance;

    /** The workers lowered so far, by pid: the nice each had before. */
    private final Map<Long, Integer> lowered = new ConcurrentHashMap<>();
    private final String refusal;

    private StartPriority(String refusal) {
        this.refusal = refusal;
    }

    static synchronized void start() {
        if (instance != null) {
            return;
        }
        instance = new StartPriority(refusal());
        if (instance.refusal != null) {
            logger.warn("new workers start at serving's CPU priority: {}", instance.refusal);
            return;
        }
        logger.info("new workers start at nice {} until their model is loaded", START_NICE);
        Executors.newSingleThreadScheduledExecutor(
                        r -> {
                            Thread thread = new Thread(r, "torchrec-serve-start-priority");
                            thread.setDaemon(true);
                            return thread;
                        })
                .scheduleWithFixedDelay(instance::tickSafely, TICK_MS, TICK_MS, TimeUnit.MILLISECONDS);
    }

    private void tickSafely() {
        try {
            tick();
        } catch (Throwable t) { // a failed tick must not end the ticks
            logger.error("torchrec-serve start priority tick failed", t);
        }
    }

    private void tick() {
        if (ModelManager.getInstance() == null) {
            return; // TorchServe is still starting
        }
        Set<Long> alive = ConcurrentHashMap.newKeySet();
        for (Model model : Guard.allModels()) {
            for (WorkerThread worker : ModelManager.getInstance().getWorkers(model.getModelVersionName())) {
                Process process = worker.getLifeCycle().getProcess();
                if (process == null || !process.isAlive()) {
                    continue;
                }
                long pid = process.pid();
                alive.add(pid);
                // only a worker on its way to loaded: one draining (scaled down) or failed serves or stops at its priority
                boolean starting = worker.getState() == WorkerState.WORKER_STARTED;
                if (starting && !lowered.containsKey(pid)) {
                    lower(worker, pid);
                } else if (!starting && lowered.containsKey(pid)) {
                    restore(worker, pid, lowered.remove(pid));
                }
            }
        }
        lowered.keySet().retainAll(alive);
    }

    private void lower(WorkerThread worker, long pid) {
        Integer before = nice(pid);
        if (before == null) {
            return; // gone already
        }
        lowered.put(pid, before);
        if (!renice(START_NICE, pid)) {
            logger.warn("worker {} (pid {}): could not lower its priority to start", worker.getWorkerId(), pid);
        }
    }

    private void restore(WorkerThread worker, long pid, int nice) {
        WorkerState state = worker.getState(); // loaded, as a rule; or failed, or stopping
        if (renice(nice, pid)) {
            logger.info("worker {} (pid {}) {}: back to nice {}", worker.getWorkerId(), pid, state, nice);
        } else {
            logger.warn("worker {} (pid {}) {}, but its priority could not be raised back to nice {}",
                    worker.getWorkerId(), pid, state, nice);
        }
    }

    /** Sets every thread of process {@code pid} to {@code nice}; false if any could not be. */
    private static boolean renice(int nice, long pid) {
        List<String> command = new ArrayList<>(List.of("renice", "-n", String.valueOf(nice), "-p"));
        try (Stream<Path> tasks = Files.list(Path.of("/proc", String.valueOf(pid), "task"))) {
            tasks.forEach(task -> command.add(task.getFileName().toString()));
        } catch (IOException e) {
            return false; // the process is gone
        }
        try {
            Process renice = new ProcessBuilder(command).redirectErrorStream(true).start();
            renice.getInputStream().readAllBytes();
            return renice.waitFor() == 0;
        } catch (IOException e) {
            return false;
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
            return false;
        }
    }

    /** The nice of process {@code pid}'s main thread (field 19 of /proc/PID/stat), or null if gone. */
    private static Integer nice(long pid) {
        try {
            String stat = Files.readString(Path.of("/proc", String.valueOf(pid), "stat"));
            String[] fields = stat.substring(stat.lastIndexOf(')') + 2).split(" ");
            return Integer.parseInt(fields[16]); // after "pid (comm) ": state is field 3, nice 19
        } catch (IOException | RuntimeException e) {
            return null;
        }
    }

    /** Why this process could not raise a worker back to its priority, or null if it can. */
    static String refusal() {
        Path status = Path.of("/proc/self/status");
        if (!Files.exists(status)) {
            return "no /proc here (Linux only)";
        }
        try {
            for (String line : Files.readAllLines(status)) {
                if (line.startsWith("CapEff:")
                        && (Long.parseUnsignedLong(line.substring(7).trim(), 16) >> CAP_SYS_NICE & 1) == 1) {
                    return null;
                }
            }
            for (String line : Files.readAllLines(Path.of("/proc/self/limits"))) {
                if (line.startsWith("Max nice priority")) {
                    String soft = line.substring("Max nice priority".length()).trim().split("\\s+")[0];
                    if (!soft.equals("unlimited") && Integer.parseInt(soft) < 20) {
                        return "raising a worker back from nice " + START_NICE + " needs CAP_SYS_NICE or "
                                + "an RLIMIT_NICE of 20 or more (ulimit -e), and this server has neither";
                    }
                    return null;
                }
            }
        } catch (IOException | RuntimeException e) {
            return "its rights could not be read: " + e;
        }
        return null;
    }
}
