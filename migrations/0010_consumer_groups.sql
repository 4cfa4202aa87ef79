-- Consumer groups (DESIGN section 7): the JetStream durable consumer a
-- partition is read through is <group>_<projection>-v<N>-p<p>, the group
-- naming the target. The consumer last used is recorded on the progress row
-- (before it is created) so that status and retire find it whatever group a
-- worker ran with; NULL: none yet, or the name before groups
-- (<projection>-v<N>-p<p>), which a worker deletes once its own consumer
-- stands at the cursor.
ALTER TABLE epitaph.progress ADD COLUMN IF NOT EXISTS consumer text;
